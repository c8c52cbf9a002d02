"""The decoder quantize stage: a pruned model outside the quality budget never ships."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")


def _no_exports(monkeypatch, quantize_stage) -> None:
    """Candidates as empty genai folders: for tests whose timings and scores are injected (the builder takes ~20 s)."""
    import json

    def exported(forms, runtimes, precisions, work, ctx):
        folders, kinds = {}, {}
        for runtime in runtimes:
            for vocabulary in forms:
                for precision in precisions[runtime.name]:
                    name = quantize_stage._in_runtime(
                        runtime, quantize_stage._candidate_name(precision, vocabulary), runtimes[0]
                    )
                    folder = work / runtime.name / f"vocab{vocabulary or 'all'}" / precision
                    folder.mkdir(parents=True)
                    config = {"model": {"vocab_size": 32}, "form": f"{work.name} {name}"}  # forms differ, as exports do
                    (folder / "genai_config.json").write_text(json.dumps(config))
                    folders[name], kinds[name] = folder, (runtime, precision, vocabulary)
        return folders, kinds

    monkeypatch.setattr(quantize_stage, "_export_candidates", exported)


def _scored_by_folder(monkeypatch, quantize_stage):
    """Exports faked (`_no_exports`), every form scored as good as dense; each scoring counted by its folder."""
    from collections import Counter

    scored = Counter()

    def losses(opened, splits):
        scored[str(opened.folder)] += 1
        return {name: np.full(len(blocks), 3.0) for name, blocks in splits.items()}

    monkeypatch.setattr(quantize_stage, "_losses", losses)
    _no_exports(monkeypatch, quantize_stage)
    return scored


def test_a_pruned_decoder_outside_the_budget_backs_off_to_dense_in_its_fastest_form(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    import json

    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.core.quality import QualityBudget
    from pruneops.runtimes.genai.generation import GenerationTiming, exported_block_losses
    from pruneops.task.causal_lm import quantize as quantize_stage
    from tests.decoder_helpers import tiny_decoder
    from tests.pruning.test_decoder_vocabulary import _recovered_layout

    layout = _recovered_layout(tmp_path)
    # What `finetune` holds is another random model: far outside any budget against the dense one.
    tiny_decoder("llama", seed=99, hidden_size=64, head_dim=16).save_pretrained(layout.stage_dir("finetune") / "model")
    tpot = {"dense int8": 2.0}  # injected: dense INT8 is the fastest form of dense

    def timed(folders, vocab, batch, benchmark, seed=0):
        return {n: GenerationTiming(9.0, tpot.get(n, 5.0), (tpot.get(n, 5.0),), 16, 8, batch) for n in folders}

    monkeypatch.setattr(quantize_stage, "_timed", timed)
    config = QuantizeConfig(decoder_precisions=["int8"], decoder_vocabulary=[], perplexity_tolerance=10.0)
    budget = QualityBudget(0.10, "perplexity")
    report = quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout, budget)
    choice = json.loads((layout.stage_dir("quantize") / "precision.json").read_text())
    pruned = choice["candidates"]["pruned fp32"]["val_change"]
    assert pruned["high"] > budget.limit  # the interval's far end: outside the budget
    assert (report.source, report.precision, choice["source"]) == ("dense", "int8", "dense")
    assert len(report.warnings) == 1 and "dense" in report.warnings[0]
    out = layout.stage_dir("quantize")
    assert all((out / "dense" / p / "genai_config.json").is_file() for p in ("fp32", "int8"))
    losses = exported_block_losses(out / "model", np.load(layout.stage_dir("validate") / "corpus.npz")["val"])
    assert np.exp(losses.mean()) == pytest.approx(choice["candidates"]["int8"]["val_perplexity"], rel=1e-5)


@pytest.mark.parametrize("general_limit", [0.15, None])
def test_a_pruned_decoder_that_forgets_general_text_backs_off_unless_that_budget_is_off(
    general_limit, tmp_path, monkeypatch
):
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.core.quality import QualityBudget
    from pruneops.runtimes.genai.generation import GenerationTiming
    from pruneops.task.causal_lm import quantize as quantize_stage
    from tests.pruning.test_decoder_vocabulary import _recovered_layout

    layout = _recovered_layout(tmp_path)
    corpus = layout.stage_dir("validate") / "corpus.npz"
    blocks = dict(np.load(corpus))
    np.savez(corpus, **blocks, general_val=blocks["val"][:12])

    def timed(folders, vocab, batch, benchmark, seed=0):  # injected: the pruned forms are the faster ones
        return {n: GenerationTiming(9.0, 5.0 if n.startswith("dense") else 2.0, (2.0,), 16, 8, batch) for n in folders}

    noise = np.random.default_rng(0).normal(0.0, 0.01, 12)

    def losses(opened, splits):  # injected: equal on the corpus; pruned loses 0.5 nats a token on general text
        worse = 0.0 if "dense" in str(opened.folder) else 0.5
        given = {"val": np.full(20, 3.0) + noise[0], "general_val": 4.0 + noise + worse}
        return {name: given[name] for name in splits}  # the splits quantize read from the corpus

    monkeypatch.setattr(quantize_stage, "_timed", timed)
    monkeypatch.setattr(quantize_stage, "_losses", losses)
    _no_exports(monkeypatch, quantize_stage)
    config = QuantizeConfig(decoder_precisions=["int8"], decoder_vocabulary=[], perplexity_tolerance=10.0)
    budget, general = QualityBudget(0.10, "perplexity"), QualityBudget(general_limit, "perplexity")
    report = quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout, budget, general)
    assert report.general_change["value"] == pytest.approx(0.0 if general_limit else np.exp(0.5) - 1, abs=1e-9)
    if general_limit is None:
        assert report.source == "pruned" and not report.warnings
    else:
        assert report.source == "dense" and "general text" in report.warnings[0]
        assert "general text +15 % perplexity" in report.budget


@pytest.mark.parametrize("limit", [3.0, None])
def test_a_pruned_decoder_that_loses_the_zero_shot_check_backs_off_unless_that_budget_is_off(
    limit, tmp_path, monkeypatch
):
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    import json

    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.core.quality import QualityBudget
    from pruneops.runtimes.genai.generation import GenerationTiming
    from pruneops.task.causal_lm import quantize as quantize_stage
    from tests.pruning.test_decoder_vocabulary import _recovered_layout

    layout = _recovered_layout(tmp_path)
    items = [{"context": [3, 4], "answer": i % 2} for i in range(40)]
    check = {"labels": ["bad", "good"], "targets": [[5], [6]], "zero_shot_val": items, "zero_shot": items}
    (layout.stage_dir("validate") / "zero_shot.json").write_text(json.dumps(check))

    def timed(folders, vocab, batch, benchmark, seed=0):  # injected: the pruned forms are the faster ones
        return {n: GenerationTiming(9.0, 5.0 if n.startswith("dense") else 2.0, (2.0,), 16, 8, batch) for n in folders}

    def losses(opened, splits):  # injected: equal perplexity everywhere
        return {name: np.full(20, 3.0) for name in splits}

    def answers(opened, given, split):  # injected: dense answers all 40; the pruned model misses 12 (-30 pts)
        right = np.ones(len(given[split]), dtype=bool)
        if "dense" not in str(opened.folder):
            right[::3] = False
        return right

    monkeypatch.setattr(quantize_stage, "_timed", timed)
    monkeypatch.setattr(quantize_stage, "_losses", losses)
    monkeypatch.setattr(quantize_stage, "zero_shot_correct", answers)
    _no_exports(monkeypatch, quantize_stage)
    config = QuantizeConfig(decoder_precisions=["int8"], decoder_vocabulary=[], perplexity_tolerance=10.0)
    budget, zero_shot = QualityBudget(0.10, "perplexity"), QualityBudget(limit, "points")
    report = quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout, budget, None, zero_shot)
    if limit is None:
        assert report.source == "pruned" and not report.warnings
        assert report.zero_shot_change["value"] == pytest.approx(-100 * 14 / 40, abs=1e-9)
    else:
        assert report.source == "dense" and "zero-shot" in report.warnings[0]
        assert report.zero_shot_change["value"] == 0.0  # dense against itself
        # The warning says how wide the check's intervals were: what more items would narrow.
        pruned = [c["zero_shot_change"] for n, c in report.candidates.items() if not n.startswith("dense")]
        widest = max(c["high"] - c["low"] for c in pruned) / 2
        assert 2.0 < widest < 25.0, report.warnings[0]  # 14 answers of 40 lost: a wide interval
        assert (
            f"the zero-shot check's 40 gating items gave intervals up to ±{widest:.1f} points "
            f"against its {limit:g}-point budget" in report.warnings[0]
        )


def test_every_export_is_scored_once_dense_fp32_included(tmp_path, monkeypatch):
    """Dense fp32 is the reference every candidate is judged against and a dense candidate itself:
    scored once (on Gemma 3's 262k-token vocabulary a scoring pass of its validation blocks is ~9 min)."""

    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.runtimes.genai.generation import GenerationTiming
    from pruneops.task.causal_lm import quantize as quantize_stage
    from tests.pruning.test_decoder_vocabulary import _recovered_layout

    layout = _recovered_layout(tmp_path)

    def timed(folders, vocab, batch, benchmark, seed=0):
        return {n: GenerationTiming(9.0, 5.0, (5.0,), 16, 8, batch) for n in folders}

    monkeypatch.setattr(quantize_stage, "_timed", timed)
    scored = _scored_by_folder(monkeypatch, quantize_stage)
    config = QuantizeConfig(decoder_precisions=["int8"], decoder_vocabulary=[], perplexity_tolerance=10.0)
    quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout)
    assert len(scored) == 4 and set(scored.values()) == {1}, scored  # pruned and dense, fp32 and int8


@pytest.mark.parametrize(("tolerance", "ships"), [(0.1, "fp32"), (0.5, "int8"), (None, "int8")])
def test_a_form_that_decodes_faster_but_prefills_slower_than_dense_ships_only_within_the_tolerance(
    tolerance, ships, tmp_path, monkeypatch
):
    """Gemma 3 in llama.cpp here: Q8_0 decoded 2.13x dense fp32 and took 1.49x its time to the first token.
    The other metric is judged against dense fp32 (what is served today), not the pruned model's own fp32."""
    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.runtimes.genai.generation import GenerationTiming
    from pruneops.task.causal_lm import quantize as quantize_stage
    from tests.pruning.test_decoder_vocabulary import _recovered_layout

    layout = _recovered_layout(tmp_path)
    ttft = {"dense fp32": 10.0, "dense int8": 15.0, "fp32": 6.0, "int8": 14.0}  # int8: 1.4x dense's, 2.3x its fp32's
    tpot = {"dense fp32": 8.0, "dense int8": 4.0, "fp32": 6.0, "int8": 3.0}

    def timed(folders, vocab, batch, benchmark, seed=0):
        return {n: GenerationTiming(ttft[n], tpot[n], (tpot[n],), 16, 8, batch) for n in folders}

    def losses(opened, splits):  # every form as good as dense
        return {name: np.full(len(blocks), 3.0) for name, blocks in splits.items()}

    monkeypatch.setattr(quantize_stage, "_timed", timed)
    monkeypatch.setattr(quantize_stage, "_losses", losses)
    _no_exports(monkeypatch, quantize_stage)
    config = QuantizeConfig(decoder_precisions=["int8"], decoder_vocabulary=[], other_metric_tolerance=tolerance)
    report = quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout)
    assert (report.source, report.precision) == ("pruned", ships)
    assert (report.tpot_b1_ms, report.ttft_b1_ms) == (tpot[ships], ttft[ships])
    if ships == "fp32":  # refused for its first token, and the warning says which key lets it through
        (warning,) = report.warnings
        assert "int8 (3.00 ms, 1.40x dense's time to the first token)" in warning
        assert "quantize.other_metric_tolerance" in warning
    else:
        assert not report.warnings


def test_a_pruned_model_slower_than_dense_to_the_first_token_in_every_form_backs_off_and_says_why(
    tmp_path, monkeypatch
):
    """Every pruned form is within quality and faster per token, and each is refused for its first token:
    dense's fastest form ships, and the warning names the other metric, not the quality budget."""
    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.runtimes.genai.generation import GenerationTiming
    from pruneops.task.causal_lm import quantize as quantize_stage
    from tests.pruning.test_decoder_vocabulary import _recovered_layout

    layout = _recovered_layout(tmp_path)
    ttft = {"dense fp32": 10.0, "dense int8": 10.5, "fp32": 12.0, "int8": 14.0}  # pruned: 1.2x and 1.4x dense's
    tpot = {"dense fp32": 8.0, "dense int8": 4.0, "fp32": 6.0, "int8": 3.0}

    def timed(folders, vocab, batch, benchmark, seed=0):
        return {n: GenerationTiming(ttft[n], tpot[n], (tpot[n],), 16, 8, batch) for n in folders}

    monkeypatch.setattr(quantize_stage, "_timed", timed)
    monkeypatch.setattr(
        quantize_stage, "_losses", lambda opened, splits: {n: np.full(len(b), 3.0) for n, b in splits.items()}
    )  # noqa: E501
    _no_exports(monkeypatch, quantize_stage)
    config = QuantizeConfig(decoder_precisions=["int8"], decoder_vocabulary=[], other_metric_tolerance=0.1)
    report = quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout)
    assert (report.source, report.precision, report.tpot_b1_ms) == ("dense", "int8", 4.0)
    (warning,) = report.warnings
    assert "more than 10 % slower than dense fp32 to the first token (fp32 1.20x, int8 1.40x dense's time)" in warning
    assert "prune.gate" not in warning


@pytest.mark.parametrize(("pruned_fp32_tpot", "ships"), [(6.0, ("dense", "int8")), (3.9, ("pruned", "fp32"))])
def test_a_pruned_form_within_the_budget_ships_only_if_faster_than_the_fastest_dense_form_within_it(
    pruned_fp32_tpot, ships, tmp_path, monkeypatch
):
    """The bench's self-calibrated cut: its INT8 just outside the budget, its fp32 within it and slower than
    dense INT8 (11.42 against 8.26 ms a token in the bench's timing): shipping it would serve slower than
    quantizing dense alone."""
    import json

    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.core.quality import DenseShips, QualityBudget
    from pruneops.runtimes.genai.generation import GenerationTiming
    from pruneops.task.causal_lm import quantize as quantize_stage
    from tests.pruning.test_decoder_vocabulary import _recovered_layout

    layout = _recovered_layout(tmp_path)
    tpot = {"dense fp32": 8.0, "dense int8": 4.0, "fp32": pruned_fp32_tpot, "int8": 3.0}

    def timed(folders, vocab, batch, benchmark, seed=0):
        return {n: GenerationTiming(10.0, tpot[n], (tpot[n],), 16, 8, batch) for n in folders}

    def losses(opened, splits):  # the pruned int8 export 0.5 nats a token worse: +65 % perplexity
        worse = "dense" not in opened.folder.parts and opened.folder.name == "int8"
        return {name: np.full(len(blocks), 3.5 if worse else 3.0) for name, blocks in splits.items()}

    monkeypatch.setattr(quantize_stage, "_timed", timed)
    monkeypatch.setattr(quantize_stage, "_losses", losses)
    _no_exports(monkeypatch, quantize_stage)
    config = QuantizeConfig(decoder_precisions=["int8"], decoder_vocabulary=[], perplexity_tolerance=10.0)
    report = quantize_stage.quantize_decoder(
        config, BenchmarkConfig(), "decode", layout, QualityBudget(0.1, "perplexity")
    )
    choice = json.loads((layout.stage_dir("quantize") / "precision.json").read_text())
    assert (report.source, report.precision) == ships
    assert report.tpot_b1_ms == (4.0 if ships[0] == "dense" else pruned_fp32_tpot)
    if ships[0] == "dense":
        assert report.dense_ships is DenseShips.NOT_FASTER and choice["dense_ships"] == "not_faster"
        (warning,) = report.warnings
        assert "fp32 at 6.00 ms a token, is no faster than dense int8 at 4.00 ms" in warning
    else:
        assert report.dense_ships is None and choice["dense_ships"] is None and not report.warnings


def test_dense_passed_on_unchanged_is_exported_timed_and_scored_once(tmp_path, monkeypatch):
    """A dense project (or a plan refused by its gate): finetune's files are train's own, so the candidates are
    dense's forms. Each is exported, timed and scored once, and dense's figures are the candidates' own."""
    import json
    import shutil

    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.runtimes.genai.generation import GenerationTiming
    from pruneops.task.causal_lm import quantize as quantize_stage
    from tests.pruning.test_decoder_vocabulary import _recovered_layout

    layout = _recovered_layout(tmp_path)
    shutil.rmtree(layout.stage_dir("finetune") / "model")
    shutil.copytree(layout.stage_dir("train") / "model", layout.stage_dir("finetune") / "model")
    exports, timed_names = [], []
    tpot = {"fp32": 8.0, "int8": 4.0}

    def timed(folders, vocab, batch, benchmark, seed=0):
        timed_names.extend(folders)
        return {n: GenerationTiming(10.0, tpot[n], (tpot[n],), 16, 8, batch) for n in folders}

    monkeypatch.setattr(quantize_stage, "_timed", timed)
    scored = _scored_by_folder(monkeypatch, quantize_stage)
    export = quantize_stage._export_candidates
    monkeypatch.setattr(quantize_stage, "_export_candidates", lambda *a: exports.append(a[3]) or export(*a))
    config = QuantizeConfig(decoder_precisions=["int8"], decoder_vocabulary=[], perplexity_tolerance=10.0)
    report = quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout)
    assert len(exports) == 1 and sorted(timed_names) == ["fp32", "int8"]
    assert len(scored) == 2 and set(scored.values()) == {1}, scored
    choice = json.loads((layout.stage_dir("quantize") / "precision.json").read_text())
    assert choice["dense_candidates"] == choice["candidates"]
    assert (report.source, report.precision, report.tpot_b1_ms, report.fastest_dense) == ("pruned", "int8", 4.0, "int8")
    out = layout.stage_dir("quantize")
    assert (out / "model" / "genai_config.json").is_file()
    assert all((out / "dense" / p / "genai_config.json").is_file() for p in ("fp32", "int8"))


def test_an_export_scored_before_is_read_back_and_a_changed_one_is_scored(tmp_path, monkeypatch):
    """A re-prune (another DVC experiment of the project) exports dense's forms again, file for file: their
    scores come from `state/cache/scores`; a form whose files differ (a new recovery) is scored."""
    import json
    from collections import Counter

    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.runtimes.genai.generation import GenerationTiming
    from pruneops.task.causal_lm import quantize as quantize_stage
    from tests.pruning.test_decoder_vocabulary import _recovered_layout

    layout = _recovered_layout(tmp_path)
    scored = Counter()

    def timed(folders, vocab, batch, benchmark, seed=0):
        return {n: GenerationTiming(9.0, 5.0, (5.0,), 16, 8, batch) for n in folders}

    def losses(opened, splits):
        scored[opened.folder.as_posix().split("/quantize/")[-1]] += 1  # within the stage's (staged) folder
        return {name: np.full(len(blocks), 3.0 + 0.01 * sum(scored.values())) for name, blocks in splits.items()}

    monkeypatch.setattr(quantize_stage, "_timed", timed)
    monkeypatch.setattr(quantize_stage, "_losses", losses)
    _no_exports(monkeypatch, quantize_stage)
    config = QuantizeConfig(decoder_precisions=["int8"], decoder_vocabulary=[], perplexity_tolerance=10.0)
    quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout)
    first = json.loads((layout.stage_dir("quantize") / "precision.json").read_text())
    assert len(scored) == 4 and len(list((layout.state_dir() / "cache" / "scores").glob("*.npz"))) == 4
    scored.clear()
    quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout)
    again = json.loads((layout.stage_dir("quantize") / "precision.json").read_text())
    assert not scored and again["candidates"] == first["candidates"]  # read back: the same figures
    export = quantize_stage._export_candidates

    def recovered_again(forms, runtimes, precisions, work, ctx):  # the recovered model's exports change
        folders, kinds = export(forms, runtimes, precisions, work, ctx)
        if work.name == "candidates":
            for folder in folders.values():
                (folder / "genai_config.json").write_text('{"model": {"vocab_size": 32}, "form": "recovered again"}')
        return folders, kinds

    monkeypatch.setattr(quantize_stage, "_export_candidates", recovered_again)
    quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout)
    assert sorted(scored) == ["candidates/genai/vocaball/fp32"]  # the two are one file now: scored once


def test_an_exports_scores_are_named_by_its_scorer_too(tmp_path, monkeypatch):
    """The same files scored by another version of the runtime's library (or changed scoring code) score again."""
    import json

    from pruneops.runtimes import get_runtime
    from pruneops.task.causal_lm import quantize as quantize_stage

    folder = tmp_path / "int8"
    folder.mkdir()
    (folder / "genai_config.json").write_text(json.dumps({"model": {"vocab_size": 32}}))
    genai, splits = get_runtime("genai"), {"val": np.arange(12).reshape(3, 4)}
    key = quantize_stage._score_key(genai, folder, splits, None)
    assert quantize_stage._score_key(genai, folder, splits, None) == key
    assert quantize_stage._score_key(genai, folder, {"val": splits["val"] + 1}, None) != key
    monkeypatch.setattr(type(genai), "versions", lambda self: {"onnxruntime_genai": "0.0.1"})
    assert quantize_stage._score_key(genai, folder, splits, None) != key
