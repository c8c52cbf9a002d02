"""`pruneops bench`'s running of variants (`pruneops.compare.run`): what it shows, what it keeps."""

from __future__ import annotations

from pruneops.compare.run import StageLines


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _progress(text: str) -> str:
    return f"2026-12-07 11:00:00,000 INFO pruneops: {text}"


def test_stage_lines_and_epochs_are_shown_as_before() -> None:
    relay = StageLines()
    assert relay("Running stage 'finetune':") == "Running stage 'finetune':"
    assert relay("Stage 'train' is cached - skipping run, checking out outputs") is not None
    fit = "2026-12-07 11:00:00,000 INFO pruneops.training.fit: epoch 2/5: val accuracy 0.91"
    assert relay(fit) == "epoch 2/5: val accuracy 0.91"
    assert relay("2026-12-07 11:00:00,000 INFO pruneops.task.causal_lm.prune: kept plan") is None
    assert relay("some library's own chatter") is None


def test_progress_of_a_long_step_is_shown_at_most_once_a_minute_per_step_and_always_at_its_end() -> None:
    clock = _Clock()
    relay = StageLines(every_s=60.0, clock=clock)
    first = "recovery: 512/150000 tokens (0%), 95.1 tokens/s, ~26 min left"
    assert relay(_progress(first)) == first  # the first line of a step: it is moving
    clock.now = 10.0
    assert relay(_progress("recovery: 1536/150000 tokens (1%), 95.0 tokens/s, ~26 min left")) is None
    other = "scoring perplexity: 20/75 blocks (27%), 4.1 blocks/s, ~13 s left"
    assert relay(_progress(other)) == other  # another step keeps its own minute
    clock.now = 60.0
    later = "recovery: 5632/150000 tokens (4%), 94.0 tokens/s, ~26 min left"
    assert relay(_progress(later)) == later
    clock.now = 70.0
    done = "recovery: 150000/150000 tokens (100%), 94.0 tokens/s, done in 27 min"
    assert relay(_progress(done)) == done  # the end of a step is always shown


def test_a_variant_keeps_the_blocks_and_the_zero_shot_check_it_was_measured_on(tmp_path) -> None:
    from pruneops.compare.run import keep_measured_data
    from pruneops.data.zero_shot import read_zero_shot

    validate = tmp_path / "validate"
    validate.mkdir()
    for name in ("corpus.npz", "zero_shot.json", "expectations.json"):
        (validate / name).write_text("{}")
    kept = keep_measured_data(validate, tmp_path / "keep" / "validate")
    assert kept == ["corpus.npz", "zero_shot.json"]  # what the bench scores; nothing else
    assert sorted(p.name for p in (tmp_path / "keep" / "validate").iterdir()) == kept
    assert read_zero_shot(tmp_path / "keep" / "validate") == {}  # the bench's rows read it from there
