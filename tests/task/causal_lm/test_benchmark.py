"""The decoder benchmark stage: a model that is two rows (dense shipped as it was) is scored once."""

from __future__ import annotations

import shutil


def test_rows_with_the_same_runtime_and_files_share_one_scoring(tmp_path):
    """Where the gate backs off, what ships is the dense row's very files: on Gemma 3 one scoring of its test
    blocks took 11 min of the benchmark's 58."""
    from pruneops.runtimes import get_runtime
    from pruneops.task.causal_lm.rows import _per_row, same_files

    llamacpp, genai = get_runtime("llamacpp"), get_runtime("genai")
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "model.gguf").write_bytes(b"GGUF" + bytes(range(64)))
    (dense / "tokenizer.json").write_text("{}")
    shipped = tmp_path / "model"
    shutil.copytree(dense, shipped)
    pruned = tmp_path / "pruned"
    shutil.copytree(dense, pruned)
    (pruned / "model.gguf").write_bytes(b"GGUF" + bytes(range(1, 65)))  # one byte apart: another model
    models = {
        "dense_fp32": (llamacpp, pruned),
        "dense_deployed": (llamacpp, dense),
        "pruned_deployed": (llamacpp, shipped),
        "other_runtime": (genai, dense),  # the same bytes read by another runtime are another row
    }
    first_of = same_files(models)
    assert first_of == {
        "dense_fp32": "dense_fp32",
        "dense_deployed": "dense_deployed",
        "pruned_deployed": "dense_deployed",
        "other_runtime": "other_runtime",
    }
    scores = _per_row({"dense_fp32": 1.0, "dense_deployed": 2.0, "other_runtime": 3.0}, first_of)
    assert scores == {"dense_fp32": 1.0, "dense_deployed": 2.0, "pruned_deployed": 2.0, "other_runtime": 3.0}
