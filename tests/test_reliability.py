"""Faults injected into real training runs: non-finite steps, preemption signals, SIGKILL during a
checkpoint save, out of memory, and checkpoints that do not fit the config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
import torch
from safetensors.torch import load_file

from simpletuner.configuration import validate_config
from simpletuner.models.sd import StableDiffusionSpec
from simpletuner.state import StateTracker
from simpletuner.train import main as train_main
from simpletuner.training import checkpoint as ckpt
from simpletuner.training.reliability import NonFiniteLoss
from simpletuner.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def _trainer(raw) -> Trainer:
    return Trainer(StateTracker(validate_config(raw), raw))


def _weights(result) -> dict[str, torch.Tensor]:
    return load_file(result.output_path)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _NanGrad(torch.autograd.Function):
    """Identity forward, NaN gradient: a finite loss whose gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def _poison(monkeypatch, calls: set[int], kind: str = "loss"):
    """Make training_loss return NaN (or a NaN gradient) on the given call numbers (1 = the FLOP count pass)."""
    real = StableDiffusionSpec.training_loss
    seen = {"n": 0}

    def poisoned(self, model, latents, conditioning, generator):
        seen["n"] += 1
        loss = real(self, model, latents, conditioning, generator)
        if seen["n"] in calls:
            return loss * float("nan") if kind == "loss" else _NanGrad.apply(loss)
        return loss

    monkeypatch.setattr(StableDiffusionSpec, "training_loss", poisoned)


@pytest.mark.parametrize("kind", ["loss", "gradient"])
def test_nonfinite_stop_saves_the_last_good_state(make_config, tmp_path, monkeypatch, kind):
    _trainer(make_config(max_train_steps=2, checkpointing_steps=2, output_dir=str(tmp_path / "clean"))).train()
    _poison(monkeypatch, {4}, kind)  # call 1 counts FLOPs; 2, 3 are steps 1, 2; 4 is step 3
    trainer = _trainer(make_config(max_train_steps=5, output_dir=str(tmp_path / "bad")))
    with pytest.raises(NonFiniteLoss, match="non-finite loss or gradient in the window after step 2") as info:
        trainer.train()
    assert "checkpoint-2" in str(info.value) and "learning_rate" in str(info.value)
    # The bad window never reached the weights: they are exactly the clean run's after 2 steps.
    saved = load_file(tmp_path / "bad" / "checkpoint-2" / "trainable.safetensors")
    assert _same(saved, load_file(tmp_path / "clean" / "checkpoint-2" / "trainable.safetensors"))
    state = json.loads((tmp_path / "bad" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["skipped_steps"] == 1


def test_nonfinite_skip_drops_the_window_without_advancing_scheduler_or_ramp(
    make_config, tmp_path, monkeypatch, caplog
):
    _poison(monkeypatch, {3})  # step 2's first try
    ramp = {
        "enable_batch_size_rampup": True,
        "initial_effective_batch_size": 2,
        "target_effective_batch_size": 6,
        "batch_rampup_steps": 6,
    }
    raw = make_config(max_train_steps=4, nonfinite_policy="skip", lr_scheduler="linear", gh200_optimizations=ramp)
    trainer = _trainer(raw)
    result = trainer.train()
    assert result.global_step == 4 and trainer.progress.skipped_steps == 1
    assert trainer.lr_scheduler.last_epoch == 4  # advanced by good steps only
    windows, seen = [], 0
    for _ in range(4):
        windows.append(trainer.accumulation.window_for(seen))
        seen += windows[-1]
    assert trainer.progress.micro_batches_seen == seen  # the skipped window did not move the ramp
    assert len(result.losses) == 4 and all(v == v for v in result.losses)  # no NaN logged as a loss
    assert "skipped the window after step 1" in caplog.text


def test_nonfinite_skip_stops_after_too_many_in_a_row(make_config, tmp_path, monkeypatch):
    _poison(monkeypatch, {3, 4, 5})
    trainer = _trainer(make_config(max_train_steps=6, nonfinite_policy="skip", max_consecutive_nonfinite=3))
    with pytest.raises(NonFiniteLoss, match="3 windows in a row"):
        trainer.train()
    assert trainer.progress.global_step == 1 and trainer.progress.skipped_steps == 3


def test_out_of_memory_explains_and_saves_nothing(make_config, tmp_path, monkeypatch, capsys):
    real = Trainer.train_step
    calls = {"n": 0}

    def oom_on_third(self, micro):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, micro)

    monkeypatch.setattr(Trainer, "train_step", oom_on_third)
    raw = make_config(max_train_steps=6, checkpointing_steps=2)
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    assert train_main(["--config", str(path)]) == 4
    err = capsys.readouterr().err
    assert "out of GPU memory during a training step (CUDA out of memory. Tried to allocate 2.00 GiB)" in err
    assert "activations" in err and "optimizer state" in err and "resume_from_checkpoint" in err
    out = Path(raw["output_dir"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not list(out.glob(".checkpoint-*")) and not (out / "pytorch_lora_weights.safetensors").exists()


def test_out_of_memory_advice_with_a_known_budget(make_config):
    from simpletuner.memory.oom import explain_out_of_memory

    config = validate_config(make_config(train_batch_size=4))
    fits = explain_out_of_memory(config, RuntimeError("oom"), usable_bytes=64 * 2**30)
    assert "Settings estimated to fit" in fits and "train_batch_size" in fits
    tight = explain_out_of_memory(config, RuntimeError("oom"), usable_bytes=2**20)
    assert "does not fit" in tight


def test_checkpoint_of_another_model_is_refused(make_config, tmp_path, tiny_sd):
    import shutil

    other = tmp_path / "other_model"
    shutil.copytree(tiny_sd, other)
    unet_cfg = other / "unet" / "config.json"
    cfg = json.loads(unet_cfg.read_text())
    cfg["sample_size"] = cfg["sample_size"] * 2  # same parameters, different model
    unet_cfg.write_text(json.dumps(cfg))
    out = tmp_path / "out"
    _trainer(make_config(max_train_steps=2, checkpointing_steps=2, output_dir=str(out))).train()
    resumed = _trainer(
        make_config(
            max_train_steps=4,
            output_dir=str(out),
            pretrained_model_name_or_path=str(other),
            resume_from_checkpoint="latest",
        )
    )
    with pytest.raises(ValueError, match="denoiser_config: checkpoint has"):
        resumed.train()


def test_amp_scaler_state_round_trips_through_a_checkpoint(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler._scale = torch.tensor(256.0)
    acc = SimpleNamespace(is_main_process=True, process_index=0, num_processes=1, wait_for_everyone=lambda: None)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path = ckpt.save_checkpoint(
        acc, tmp_path, 1, {"p": param}, opt, sched, {"identity": {}}, torch.Generator(), None, scaler=scaler
    )
    loaded = ckpt.load_tensors(path, 0)
    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(loaded["scaler"])
    assert restored.get_scale() == 256.0


# --- real processes: signals and kills ----------------------------------------------------------
def _spawn(config: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "simpletuner.train", "--config", str(config)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **env),
    )


def _write(tmp_path, raw, name="cfg.json") -> Path:
    path = tmp_path / name
    path.write_bytes(orjson.dumps(raw))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_preemption_saves_at_a_step_boundary_and_resumes_exactly(make_config, tmp_path, sig, code):
    total = 40
    straight = _trainer(make_config(max_train_steps=total, output_dir=str(tmp_path / "straight"))).train()
    out = tmp_path / "run"
    raw = make_config(max_train_steps=total, output_dir=str(out), logging_steps=1)
    proc = _spawn(_write(tmp_path, raw))
    lines = []
    for line in proc.stderr:  # wait until training is under way
        lines.append(line)
        if "step 3/" in line:
            proc.send_signal(sig)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == code, "".join(lines[-20:]) + rest[-3000:]
    assert f"stopped by {signal.Signals(sig).name}" in rest
    latest = ckpt.find_latest(out)
    assert latest is not None and 3 <= int(latest.name.split("-")[1]) < total
    resumed = _trainer(dict(raw, resume_from_checkpoint="latest")).train()
    assert resumed.global_step == total
    assert _same(_weights(straight), _weights(resumed))


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    ["checkpoint:files_written", "checkpoint:marker_written", "checkpoint:renamed", "checkpoint:latest_written"],
)
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(make_config, tmp_path, point):
    straight = _trainer(make_config(max_train_steps=6, output_dir=str(tmp_path / "straight"))).train()
    out = tmp_path / "run"
    raw = make_config(max_train_steps=6, output_dir=str(out), checkpointing_steps=2, checkpoints_total_limit=1)
    proc = _spawn(_write(tmp_path, raw), SIMPLETUNER_FAULT=f"{point}@2")  # die while saving checkpoint-4
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    latest = ckpt.find_latest(out)
    assert latest is not None and ckpt.is_complete(latest)
    # Until `latest` is rewritten it names checkpoint-2, which retention has not removed.
    assert latest.name == ("checkpoint-4" if point == "checkpoint:latest_written" else "checkpoint-2")
    assert (out / "latest").read_text() == latest.name
    resumed = _trainer(dict(raw, resume_from_checkpoint="latest")).train()
    assert resumed.global_step == 6
    assert _same(_weights(straight), _weights(resumed))
    assert not list(out.glob(".checkpoint-*")), list(out.iterdir())
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-6"]
