"""Recovery by distillation within a token budget, on a tiny Llama cut in half."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from pruneops.core.errors import ConfigError  # noqa: E402
from pruneops.models.language import block_losses  # noqa: E402
from pruneops.pruning import decoder_cuts as D  # noqa: E402
from pruneops.training.recovery import RecoverySettings, distillation_loss, recover_  # noqa: E402
from tests.decoder_helpers import random_blocks, tiny_decoder  # noqa: E402


def _kl_to(teacher, student, blocks):
    with torch.inference_mode():
        return float(distillation_loss(student(input_ids=blocks).logits, teacher(input_ids=blocks).logits, 1.0))


def _student_with_half_its_mlp():
    """A tiny Llama teacher, a copy of it with its MLP cut in half, and training and held-out blocks."""
    teacher = tiny_decoder("llama")
    student = copy.deepcopy(teacher)
    train, held_out = random_blocks(32, 16, seed=1), random_blocks(8, 16, seed=2)
    D.prune_mlp_(student, 16, D.calibrate(teacher, train[:8]), "activation", reconstruct=False)
    return teacher, student, train, held_out


def test_distillation_loss_is_zero_for_equal_logits_and_positive_otherwise():
    logits = torch.randn(2, 5, 11)
    assert float(distillation_loss(logits, logits, 2.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(distillation_loss(logits, logits.flip(-1), 2.0)) > 0


@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_recovery_spends_exactly_its_budget_and_brings_the_student_closer_to_the_teacher(compute_dtype):
    teacher, student, train, held_out = _student_with_half_its_mlp()
    before = _kl_to(teacher, student, held_out)
    seen = []
    result = recover_(
        student,
        teacher,
        train,
        RecoverySettings(max_tokens=120 * 16 + 5, batch_blocks=4, lr=3e-3, compute_dtype=compute_dtype),
        progress=lambda used, loss: seen.append(used),
    )
    # whole blocks up to the budget: 120 blocks and one more for the 5 tokens left
    assert result.tokens == 121 * 16 and seen[-1] == result.tokens and result.steps == 31
    after = _kl_to(teacher, student, held_out)
    assert after < 0.8 * before, (before, after)
    assert not student.training
    assert all(p.dtype == torch.float32 for p in student.parameters())  # bf16 is compute only


def test_bf16_on_a_cpu_without_bfloat16_instructions_is_a_warning(monkeypatch, caplog):
    import pruneops.training.recovery as R

    monkeypatch.setattr(R, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert "runs emulated" in R.compute_dtype_warning("bf16")
    assert R.compute_dtype_warning("fp32") is None
    model = tiny_decoder("llama")
    recover_(copy.deepcopy(model), model, random_blocks(4, 16), RecoverySettings(max_tokens=16, compute_dtype="bf16"))
    assert any("runs emulated" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(R, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert R.compute_dtype_warning("bf16") is None


def test_recovery_never_touches_the_teacher():
    teacher = tiny_decoder("qwen2")
    student = copy.deepcopy(teacher)
    blocks = random_blocks(4, 12)
    reference = block_losses(teacher, blocks)
    recover_(student, teacher, blocks, RecoverySettings(max_tokens=48, lr=1e-2))
    assert (block_losses(teacher, blocks) == reference).all()


def test_a_budget_below_one_block_is_refused():
    model = tiny_decoder("llama")
    with pytest.raises(ConfigError, match="less than one 16-token block"):
        recover_(model, model, random_blocks(4, 16), RecoverySettings(max_tokens=8))


def test_progress_marks_record_evenly_spaced_steps():
    import logging

    from pruneops.training.recovery import progress_marks

    history: list[dict] = []
    progress = progress_marks(1000, 4, logging.getLogger("test"), history)
    for used in range(64, 1025, 64):  # 16 steps of 64 tokens
        progress(used, used / 1000)
    assert [row["tokens"] for row in history] == [64, 320, 576, 832]  # every 250 tokens, at the next step
    assert [row["step"] for row in history] == [0, 1, 2, 3] and history[-1]["loss"] == 0.832


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal of a missing CUDA device: this machine has one")
def test_a_cuda_device_that_torch_does_not_see_is_refused_before_training():
    model = tiny_decoder("llama")
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"recovery device 'cuda': torch .* sees 0 CUDA device\(s\) here; use cpu"):
        recover_(copy.deepcopy(model), model, random_blocks(4, 16), RecoverySettings(max_tokens=16, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(("name", "message"), [("meta", "trains on cpu or cuda"), ("gpu0", "not a torch device")])
def test_a_device_recovery_cannot_train_on_is_refused(name, message):
    from pruneops.training.recovery import training_device

    with pytest.raises(ConfigError, match=message):
        training_device(name)


def test_finetune_takes_only_cpu_or_cuda_devices():
    from pydantic import ValidationError

    from pruneops.config import FinetuneConfig

    assert FinetuneConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValidationError, match="device"):
        FinetuneConfig(device="tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_recovery_on_cuda_trains_there_and_hands_both_models_back_on_the_cpu(compute_dtype):
    teacher, student, train, held_out = _student_with_half_its_mlp()
    before = _kl_to(teacher, student, held_out)
    settings = RecoverySettings(
        max_tokens=120 * 16, batch_blocks=4, lr=3e-3, compute_dtype=compute_dtype, device="cuda"
    )
    recover_(student, teacher, train, settings)
    assert {p.device.type for m in (student, teacher) for p in m.parameters()} == {"cpu"}
    assert _kl_to(teacher, student, held_out) < 0.8 * before
    # perplexity on the GPU agrees with the CPU's to float tolerance (different kernels, same sums)
    cpu = block_losses(student, held_out)
    cuda = block_losses(student.cuda(), held_out)
    assert abs(cuda - cpu).max() < 1e-3 * abs(cpu).max()


class _Stop(Exception):
    """A recovery stopped mid-run (the process killed, in effect)."""


def _stopped_after(steps: int):
    def progress(used, loss):
        progress.calls += 1
        if progress.calls == steps:
            raise _Stop

    progress.calls = 0
    return progress


@pytest.mark.parametrize("lora_rank", [None, 2])
def test_a_stopped_recovery_resumes_from_its_checkpoint_and_ends_where_one_run_would(tmp_path, lora_rank):
    from pruneops.training.recovery import Checkpoint

    teacher, student, train, _ = _student_with_half_its_mlp()
    settings = RecoverySettings(max_tokens=10 * 4 * 16, batch_blocks=4, lr=3e-3, lora_rank=lora_rank)
    torch.manual_seed(0)  # LoRA's adapters start from torch's global generator
    one_run = recover_(copy.deepcopy(student), teacher, train, settings)
    checkpoint = Checkpoint(tmp_path, every_s=0.0)  # saved after every step
    torch.manual_seed(0)
    with pytest.raises(_Stop):
        recover_(copy.deepcopy(student), teacher, train, settings, _stopped_after(4), checkpoint)
    (saved,) = tmp_path.iterdir()  # one file, whole: no partial save left beside it
    assert saved.name.startswith("recovery-") and saved.suffix == ".pt"
    seen = []
    torch.manual_seed(1)  # the adapters come from the checkpoint, whatever a fresh start would draw
    resumed = recover_(copy.deepcopy(student), teacher, train, settings, lambda used, _: seen.append(used), checkpoint)
    assert (
        resumed.checkpoint == saved
        and resumed.resumed_tokens == 4 * 4 * 16
        and seen == [step * 4 * 16 for step in range(5, 11)]
    )
    assert (resumed.tokens, resumed.steps) == (one_run.tokens, one_run.steps)
    # the same losses from step 5 on: the resumed run left from the checkpoint's weights and optimiser
    assert resumed.losses == pytest.approx(one_run.losses, rel=1e-5, abs=1e-7)


def test_a_checkpoint_of_other_inputs_or_cut_short_is_not_resumed(tmp_path, caplog):
    import logging

    from pruneops.training.recovery import Checkpoint

    caplog.set_level(logging.INFO, logger="pruneops.training.recovery")

    teacher, student, train, _ = _student_with_half_its_mlp()
    settings = RecoverySettings(max_tokens=6 * 4 * 16, batch_blocks=4, lr=3e-3)
    checkpoint = Checkpoint(tmp_path, every_s=0.0)
    with pytest.raises(_Stop):
        recover_(copy.deepcopy(student), teacher, train, settings, _stopped_after(3), checkpoint)
    other = recover_(copy.deepcopy(student), teacher, train, RecoverySettings(**{**settings.__dict__, "lr": 1e-3}),
                     checkpoint=checkpoint)  # fmt: skip
    assert other.resumed_tokens == 0 and other.steps == 6 and len(list(tmp_path.iterdir())) == 2  # a file each
    (stopped,) = [p for p in tmp_path.iterdir() if p != other.checkpoint]
    stopped.write_bytes(stopped.read_bytes()[:100])  # a save cut short by hand
    fresh = recover_(copy.deepcopy(student), teacher, train, settings, checkpoint=checkpoint)
    assert fresh.resumed_tokens == 0 and fresh.steps == 6
    assert any("cannot be read" in r.getMessage() for r in caplog.records)


def test_other_runs_checkpoints_untouched_for_keep_days_are_swept_when_a_recovery_starts(tmp_path, caplog):
    import logging
    import os
    import time

    from pruneops.training.recovery import Checkpoint

    caplog.set_level(logging.INFO, logger="pruneops.training.recovery")
    teacher, student, train, _ = _student_with_half_its_mlp()
    settings = RecoverySettings(max_tokens=3 * 4 * 16, batch_blocks=4, lr=3e-3)
    checkpoint = Checkpoint(tmp_path, every_s=0.0, keep_days=7.0)
    with pytest.raises(_Stop):
        recover_(copy.deepcopy(student), teacher, train, settings, _stopped_after(2), checkpoint)
    (own,) = tmp_path.iterdir()
    week = 7 * 86400
    old, recent, partial = (
        tmp_path / "recovery-0123456789abcdef.pt",
        tmp_path / "recovery-fedcba9876543210.pt",
        tmp_path / "recovery-0011223344556677.partial.pt",
    )
    for path, age in ((own, week + 60), (old, week + 60), (recent, week - 60), (partial, week + 60)):
        path.write_bytes(path.read_bytes() if path == own else b"x" * 1000)
        os.utime(path, (time.time() - age,) * 2)
    resumed = recover_(copy.deepcopy(student), teacher, train, settings, checkpoint=checkpoint)
    assert resumed.resumed_tokens == 2 * 4 * 16  # its own file, however old, is resumed, not swept
    assert sorted(tmp_path.iterdir()) == sorted([own, recent])
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("recovery: removed")]
    assert len(removed) == 2 and any(
        "kept" in r.getMessage() and "1 checkpoint(s)" in r.getMessage() for r in caplog.records
    )


def test_progress_marks_of_a_resumed_recovery_replay_its_steps_and_count_the_rest():
    import logging

    from pruneops.training.recovery import progress_marks

    history: list[dict] = []
    progress = progress_marks(1000, 4, logging.getLogger("test"), history)
    progress.resume([(used, used / 1000) for used in range(64, 449, 64)])  # 7 steps done before the stop
    for used in range(512, 1025, 64):
        progress(used, used / 1000)
    assert [row["tokens"] for row in history] == [64, 320, 576, 832]  # as one run's marks
    assert progress.counter.total == 1000 - 448 and progress.counter.done == 1024 - 448
