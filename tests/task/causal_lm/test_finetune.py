"""The decoder finetune stage's recovery data: the corpus, and text the dense model writes itself."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from pruneops.config import FinetuneConfig  # noqa: E402
from pruneops.models.language import SELF_TEXT_PROMPT, self_written_blocks  # noqa: E402
from pruneops.task.causal_lm.finetune import _with_self_text  # noqa: E402
from tests.decoder_helpers import random_blocks, tiny_decoder  # noqa: E402


def test_self_written_blocks_continue_their_starts_to_full_length_reproducibly():
    model = tiny_decoder("llama").eval()
    starts = random_blocks(5, length=SELF_TEXT_PROMPT).numpy()
    written = self_written_blocks(model, starts, 24, seed=3, batch=2)
    assert written.shape == (5, 24)
    np.testing.assert_array_equal(written[:, :SELF_TEXT_PROMPT], starts)
    np.testing.assert_array_equal(self_written_blocks(model, starts, 24, seed=3, batch=2), written)
    assert not np.array_equal(self_written_blocks(model, starts, 24, seed=4, batch=2), written)


@pytest.mark.parametrize(("fraction", "added"), [(0.0, 0), (0.5, 10), (0.2, 2)])
def test_self_text_makes_up_its_share_of_the_recovery_blocks(fraction, added):
    model = tiny_decoder("llama").eval()
    train = random_blocks(10, length=24).numpy()
    mixed, written = _with_self_text(model, train, FinetuneConfig(self_text_fraction=fraction))
    assert written == added and mixed.shape == (10 + added, 24)
    np.testing.assert_array_equal(mixed[:10], train)  # the corpus blocks first, as they were
    if added:
        assert written / len(mixed) == pytest.approx(fraction, abs=0.05)


def test_self_text_writes_only_the_blocks_recovery_reads():
    model = tiny_decoder("llama").eval()
    train = random_blocks(40, length=24).numpy()
    config = FinetuneConfig(self_text_fraction=0.5, max_tokens=10 * 24)  # recovery reads 10 blocks of 40 + 40
    mixed, written = _with_self_text(model, train, config)
    assert written == 5 and mixed.shape == (10, 24)
    rows = {row.tobytes() for row in train}
    assert all(row.tobytes() in rows for row in mixed[:5])  # the rest are corpus blocks, drawn from the split
    assert not any(row.tobytes() in rows for row in mixed[5:])


def test_a_stopped_finetune_resumes_and_drops_its_checkpoint_once_its_outputs_are_written(tmp_path, monkeypatch):
    import json

    import pruneops.training.recovery as recovery
    from pruneops.core.io import Layout
    from pruneops.task.causal_lm import finetune as finetune_stage
    from tests.pruning.test_decoder_vocabulary import _recovered_layout

    layout = _recovered_layout(tmp_path)  # dense in train, a nudged copy of it in finetune: here, the pruned one
    layout.stage_dir("prune").mkdir(parents=True)
    (layout.stage_dir("finetune") / "model").rename(layout.stage_dir("prune") / "model")
    (layout.stage_dir("prune") / "plan.json").write_text(json.dumps({"pruned": True}))
    monkeypatch.setattr(finetune_stage, "CHECKPOINT_EVERY_S", 0.0)  # saved after every step
    config = FinetuneConfig(max_tokens=8 * 2 * 32, batch_size=2, lr=1e-3)
    step, calls = recovery.ProgressMarks.__call__, []

    def stopped_at_the_third(self, used, loss):
        calls.append(used)
        if len(calls) == 3:
            raise KeyboardInterrupt
        step(self, used, loss)

    monkeypatch.setattr(recovery.ProgressMarks, "__call__", stopped_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        finetune_stage.recover_decoder(config, layout)
    (checkpoint,) = (Layout(tmp_path).state_dir() / "cache" / "recovery").iterdir()
    assert not (layout.stage_dir("finetune") / "model").exists()
    report = finetune_stage.recover_decoder(config, layout)
    assert (report.resumed_tokens, report.tokens, report.steps) == (3 * 2 * 32, 8 * 2 * 32, 8)
    assert "resumed at 192" in report.summary()
    assert not checkpoint.exists() and (layout.stage_dir("finetune") / "model" / "config.json").is_file()
