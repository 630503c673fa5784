"""GH200GradientRamp: the exact window sequence, its errors, and resume mid-ramp."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from simpletuner.configuration import ConfigError, validate_config
from simpletuner.gh200.ramp import GH200GradientRamp
from simpletuner.state import StateTracker
from simpletuner.training.accumulation import count_steps
from simpletuner.training.trainer import Trainer


def _windows(ramp, steps):
    seen, out = 0, []
    for _ in range(steps):
        w = ramp.window_for(seen)
        out.append(w)
        seen += w
    return out


def test_exact_sequence():
    # 2 samples/micro-batch; 4 -> 16 samples over 12 micro-batches.
    ramp = GH200GradientRamp(4, 16, 12, micro_batch_size=2, num_processes=1)
    # seen: 0 (4 -> w2), 2 (6 -> 3), 5 (9 -> 4), 9 (13 -> 6), 15+ -> 8
    assert _windows(ramp, 7) == [2, 3, 4, 6, 8, 8, 8]
    assert [ramp.window_for(m) for m in (0, 6, 11, 12, 1000)] == [2, 5, 7, 8, 8]  # 6 seen: 4 + 12*6/12 = 10 -> 5


def test_is_pure_and_counts_processes():
    a = GH200GradientRamp(8, 32, 10, micro_batch_size=2, num_processes=2)
    b = GH200GradientRamp(8, 32, 10, micro_batch_size=2, num_processes=2)
    assert [a.window_for(m) for m in range(15)] == [b.window_for(m) for m in reversed(range(15))][::-1]
    assert a.window_for(0) == 2 and a.window_for(10) == 8
    assert GH200GradientRamp(4, 4, 0, 4).window_for(0) == 1


def test_steps_for_epochs():
    ramp = GH200GradientRamp(4, 16, 12, micro_batch_size=2)
    assert count_steps(ramp, 23) == 5  # 2+3+4+6+8 = 23 micro-batches


@pytest.mark.parametrize(
    "args, message",
    [
        ((16, 8, 10, 2, 1), "only grows"),
        ((4, 18, 10, 2, 2), "not a multiple of train_batch_size 2 x 2 process"),
        ((2, 16, 10, 4, 1), "smaller than one micro-batch"),
    ],
)
def test_invalid_combinations(args, message):
    with pytest.raises(ValueError, match=message):
        GH200GradientRamp(*args)


def test_config_errors_before_anything_loads(make_config):
    raw = make_config(
        train_batch_size=3,
        gh200_optimizations={
            "enable_batch_size_rampup": True,
            "initial_effective_batch_size": 4,
            "target_effective_batch_size": 16,
        },
    )
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    assert any(
        "initial_effective_batch_size 4 is not a multiple of train_batch_size 3" in p for p in info.value.problems
    )
    raw = make_config(gh200_optimizations={"enable_batch_size_rampup": True, "target_effective_batch_size": 16})
    with pytest.raises(ConfigError, match="needs initial_effective_batch_size"):
        validate_config(raw)


def _train(raw):
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    return trainer, trainer.train()


RAMP = {
    "enable_batch_size_rampup": True,
    "initial_effective_batch_size": 2,
    "target_effective_batch_size": 6,
    "batch_rampup_steps": 6,
}


def test_trainer_follows_the_ramp_logs_and_records(make_config, caplog):
    caplog.set_level(logging.DEBUG, logger="simpletuner.gh200.ramp")
    trainer, result = _train(make_config(max_train_steps=6, gh200_optimizations=RAMP))
    # 2 samples per micro-batch; desired effective batch 2 + 4 * seen / 6, floored to whole micro-batches:
    # seen 0 -> 1, 1 (2.67) -> 1, 2 (3.33) -> 1, 3 (4.0) -> 2, 5 (5.33) -> 2, 7 (past the ramp) -> 3
    assert trainer.progress.micro_batches_seen == 1 + 1 + 1 + 2 + 2 + 3
    assert trainer.progress.samples_seen == 2 * 10
    messages = [r.getMessage() for r in caplog.records]
    assert sum("GH200 gradient accumulation ramp enabled" in m for m in messages) == 1
    assert [m for m in messages if "ramp adjusted" in m][:3] == [
        "GH200 ramp adjusted gradient_accumulation_steps -> 1",
        "GH200 ramp adjusted gradient_accumulation_steps -> 2",
        "GH200 ramp adjusted gradient_accumulation_steps -> 3",
    ]
    assert trainer.state.gh200_runtime_config["accumulation"]["kind"] == "gh200_ramp"


def test_resume_mid_ramp_continues_the_same_sequence(make_config, tmp_path):
    straight, s_result = _train(
        make_config(max_train_steps=6, output_dir=str(tmp_path / "a"), gh200_optimizations=RAMP)
    )
    out = tmp_path / "b"
    _train(make_config(max_train_steps=6, output_dir=str(out), checkpointing_steps=3, gh200_optimizations=RAMP))
    resumed, r_result = _train(
        make_config(
            max_train_steps=6,
            output_dir=str(out),
            gh200_optimizations=RAMP,
            resume_from_checkpoint=str(out / "checkpoint-3"),
        )
    )
    assert resumed.progress == straight.progress
    assert r_result.losses == s_result.losses[3:]
    want, got = load_file(s_result.output_path), load_file(r_result.output_path)
    assert all(torch.equal(want[k], got[k]) for k in want)
