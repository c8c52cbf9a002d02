"""The runtime seam: only `pruneops/runtimes/<name>/` imports its runtime, and every runtime keeps the protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import pruneops
from pruneops.data.zero_shot import answer_losses
from pruneops.runtimes import LIBRARIES, RUNTIMES, get_runtime, runtimes_for
from pruneops.runtimes.base import Runtime

PACKAGE = Path(pruneops.__file__).parent
PROJECT = PACKAGE.parent


def runtime_imports(source: str) -> set[str]:
    """The runtime libraries a module's source imports (anywhere in it, lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        found |= {n.split(".")[0] for n in names} & set(LIBRARIES.values())
    return found


def misplaced(files: list[Path], package: Path = PACKAGE) -> list[str]:
    """`file: library` for every import of a runtime library outside that runtime's own folder."""
    home = {library: package / "runtimes" / name for name, library in LIBRARIES.items()}
    out = []
    for path in files:
        for library in sorted(runtime_imports(path.read_text())):
            if not path.is_relative_to(home[library]):
                out.append(f"{path.relative_to(package.parent).as_posix()}: {library}")
    return out


def _python_files() -> list[Path]:
    roots = [PACKAGE, PROJECT / "flows", PROJECT / "tasks"]
    return sorted(p for root in roots if root.is_dir() for p in root.rglob("*.py"))


def test_only_a_runtimes_own_folder_imports_it():
    assert misplaced(_python_files()) == []


def test_an_import_of_a_runtime_outside_its_folder_is_found(tmp_path):
    package = tmp_path / "pruneops"
    sources = {
        "serving/app.py": "import onnxruntime_genai as og\n",  # outside any runtime: found
        "task/prune.py": "def f():\n    from onnxruntime import InferenceSession\n",  # a lazy import: found
        "runtimes/genai/engine.py": "import onnxruntime_genai\nimport onnxruntime\n",  # the other runtime's: found
        "runtimes/onnxruntime/files.py": "import onnxruntime.quantization\n",  # its own: fine
    }
    for name, source in sources.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(source)
    found = misplaced(sorted(package.rglob("*.py")), package)
    assert found == [
        "pruneops/runtimes/genai/engine.py: onnxruntime",
        "pruneops/serving/app.py: onnxruntime_genai",
        "pruneops/task/prune.py: onnxruntime",
    ]


def test_every_registered_runtime_keeps_the_protocol():
    assert set(LIBRARIES) == set(RUNTIMES)
    for name in RUNTIMES:
        runtime = get_runtime(name)
        assert isinstance(runtime, Runtime) and runtime.name == name
        assert runtime.precisions[0] == "fp32" and (PACKAGE / "runtimes" / name / "__init__.py").is_file()
        assert runtime.versions()
    assert [r.name for r in runtimes_for("classification")] == ["onnxruntime"]
    assert [r.name for r in runtimes_for("causal_lm")] == ["genai", "llamacpp"]


def test_an_unknown_runtime_or_precision_is_refused_in_one_line():
    from pruneops.core.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown runtime 'llama'"):
        get_runtime("llama")
    with pytest.raises(ValueError, match="genai: no precision 'q4_k_m'"):
        get_runtime("genai").check_precisions(["fp32", "q4_k_m"])


def test_the_onnxruntime_runtime_exports_opens_times_and_describes_a_classifier(tmp_path):
    from pruneops.config import BenchmarkConfig
    from pruneops.runtimes.onnxruntime import BatchWorkload

    runtime = get_runtime("onnxruntime")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8, 3)).eval()
    calibration = np.random.default_rng(0).random((8, 8), dtype=np.float32)
    exported = runtime.export(model, tmp_path, ["fp32", "dynamic"], input_shape=[8], calibration=calibration)
    assert set(exported) == {"fp32", "dynamic"} and all(runtime.recognises(p) for p in exported.values())
    x = calibration[:4]
    with torch.no_grad():
        expected = model(torch.as_tensor(x)).numpy()
    assert np.abs(runtime.open(exported["fp32"]).run(None, {"input": x})[0] - expected).max() < 1e-5
    timing = BenchmarkConfig(batch_sizes=[1], warmup=1, repeats=3, rounds=1)
    samples = runtime.time(exported, BatchWorkload(x[:1], timing))
    assert {name: s[1].shape for name, s in samples.items()} == {"fp32": (3,), "dynamic": (3,)}
    assert runtime.contract(exported["fp32"], {})["num_classes"] == 3
    assert runtime.files(exported["fp32"]) == [exported["fp32"]]


def test_the_genai_runtime_opens_times_scores_and_describes_a_decoder(tiny_genai_decoder, tmp_path):
    from pruneops.timing.generation import DecodeWorkload

    runtime = get_runtime("genai")
    folder = tiny_genai_decoder[1]
    assert runtime.recognises(folder) and not runtime.recognises(tmp_path)
    model = runtime.open(folder)
    blocks = np.random.default_rng(0).integers(0, model.vocab_size, (2, 12))
    losses = model.losses(blocks)
    per_token = model.token_losses(blocks[0])
    assert losses.shape == (2,) and abs(per_token.mean() - losses[0]) < 1e-5
    context, answers = blocks[1, :6].tolist(), [[3], [4]]  # the zero-shot check's answers: one prefill for both
    alone = [float(model.token_losses(np.asarray(context + a))[len(context) - 1 :].sum()) for a in answers]
    assert answer_losses(model, context, answers) == pytest.approx(alone, rel=1e-5)
    prompt = blocks[:1, :6]
    greedy = model.greedy(prompt, 4)
    generation = model.start(prompt[0].tolist(), max_length=10)
    assert [generation.step() for _ in range(4)] == greedy[0].tolist()
    timings = runtime.time({"a": folder, "b": folder}, DecodeWorkload(prompt, new_tokens=3, rounds=1))
    assert set(timings) == {"a", "b"} and all(t.tpot_ms > 0 for t in timings.values())
    assert runtime.contract(folder, {})["num_classes"] == model.vocab_size
    assert (folder / "genai_config.json") in runtime.files(folder)
