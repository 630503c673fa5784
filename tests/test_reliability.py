"""Faults injected into real training runs: non-finite steps, preemption signals, SIGKILL during a
checkpoint save, out of memory, and checkpoints that do not fit the config."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
import torch
from fakes import NanGradient
from safetensors.torch import load_file
from training_helpers import same_weights, tiny_config

from simpletuner.cli.train import main as train_main
from simpletuner.configuration import validate_config
from simpletuner.models.sd import StableDiffusionSpec
from simpletuner.state import StateTracker
from simpletuner.training import checkpoint as ckpt
from simpletuner.training.reliability import NonFiniteLoss
from simpletuner.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def _trainer(raw) -> Trainer:
    return Trainer(StateTracker(validate_config(raw), raw))


def _weights(result) -> dict[str, torch.Tensor]:
    return load_file(result.output_path)


@pytest.fixture(scope="module")
def reference(tiny_sd, shapes_dir, tmp_path_factory):
    """``reference(**overrides)`` -> the output_dir of an undisturbed in-process run of the tiny
    config with those overrides, trained once for the module (one shared cache, ``reference.cache_dir``, which
    the real processes below read too: filled once, not once per process). Read only: a test that trains on
    from one copies it first."""
    root = tmp_path_factory.mktemp("reference")
    done: dict[tuple, Path] = {}

    def run(**overrides) -> Path:
        key = tuple(sorted(overrides.items()))
        if key not in done:
            out = root / f"run-{len(done)}"
            _trainer(tiny_config(tiny_sd, shapes_dir, root, output_dir=str(out), **overrides)).train()
            done[key] = out
        return done[key]

    run.cache_dir = root / "cache"
    return run


def _poison(monkeypatch, calls: set[int], kind: str = "loss"):
    """Make training_loss return NaN (or a NaN gradient) on the given call numbers (1 = the FLOP count pass)."""
    real = StableDiffusionSpec.training_loss
    seen = {"n": 0}

    def poisoned(self, model, latents, conditioning, generator, **kwargs):
        seen["n"] += 1
        loss = real(self, model, latents, conditioning, generator, **kwargs)
        if seen["n"] in calls:
            return loss * float("nan") if kind == "loss" else NanGradient.apply(loss)
        return loss

    monkeypatch.setattr(StableDiffusionSpec, "training_loss", poisoned)


@pytest.mark.parametrize("kind", ["loss", "gradient"])
def test_nonfinite_stop_saves_the_last_good_state(reference, make_config, tmp_path, monkeypatch, kind):
    clean = reference(max_train_steps=2, checkpointing_steps=2)
    _poison(monkeypatch, {4}, kind)  # call 1 counts FLOPs; 2, 3 are steps 1, 2; 4 is step 3
    trainer = _trainer(make_config(max_train_steps=5, output_dir=str(tmp_path / "bad")))
    with pytest.raises(NonFiniteLoss, match="non-finite loss or gradient in the window after step 2") as info:
        trainer.train()
    assert "checkpoint-2" in str(info.value) and "learning_rate" in str(info.value)
    # The bad window never reached the weights: they are exactly the clean run's after 2 steps.
    saved = load_file(tmp_path / "bad" / "checkpoint-2" / "trainable.safetensors")
    assert same_weights(saved, load_file(clean / "checkpoint-2" / "trainable.safetensors"))
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


def test_checkpoint_of_another_model_is_refused(reference, make_config, tmp_path, tiny_sd):
    other = tmp_path / "other_model"
    shutil.copytree(tiny_sd, other)
    unet_cfg = other / "unet" / "config.json"
    cfg = json.loads(unet_cfg.read_text())
    cfg["sample_size"] = cfg["sample_size"] * 2  # same parameters, different model
    unet_cfg.write_text(json.dumps(cfg))
    out = tmp_path / "out"
    shutil.copytree(reference(max_train_steps=2, checkpointing_steps=2), out)  # a 2-step run, checkpoint-2
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
    contents = ckpt.CheckpointContents({"p": param}, opt, sched, {"identity": {}}, torch.Generator(), scaler=scaler)
    path = ckpt.Checkpointer(acc, tmp_path, None, "abc123").write(1, contents)
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


PREEMPT_STEPS = 40  # long enough that the signal at step 3 lands well before the end
KILL_POINTS = [
    "checkpoint:files_written",
    "checkpoint:marker_written",
    "checkpoint:renamed",
    "checkpoint:latest_written",
]


def _preempt_raw(tiny_sd, shapes_dir, root: Path, cache_dir: Path) -> dict:
    return tiny_config(
        tiny_sd,
        shapes_dir,
        root,
        max_train_steps=PREEMPT_STEPS,
        output_dir=str(root / "run"),
        cache_config={"cache_dir": str(cache_dir)},
    )


def _kill_raw(tiny_sd, shapes_dir, root: Path, cache_dir: Path) -> dict:
    return tiny_config(
        tiny_sd,
        shapes_dir,
        root,
        max_train_steps=6,
        output_dir=str(root / "run"),
        checkpointing_steps=2,
        checkpoints_total_limit=1,
        cache_config={"cache_dir": str(cache_dir)},
    )


def _signal_at_step_3(proc: subprocess.Popen, sig: signal.Signals, seen: list[str], rest: list[str]) -> None:
    for line in proc.stderr:  # wait until training is under way
        seen.append(line)
        if "step 3/" in line:
            proc.send_signal(sig)
            break
    rest.append(proc.stderr.read())


@pytest.fixture(scope="module")
def preempted(tiny_sd, shapes_dir, tmp_path_factory, reference):
    """signal -> (root, exit code, stderr before the signal, stderr after it) of a real run signalled
    at step 3. Both runs go at once (most of each is importing), and meanwhile the undisturbed run
    trains in this process. Read only: a test copies ``root`` before it resumes."""
    base = tmp_path_factory.mktemp("preempted")
    runs = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        root = base / sig.name
        root.mkdir()
        proc = _spawn(_write(root, _preempt_raw(tiny_sd, shapes_dir, root, reference.cache_dir)))
        seen, rest = [], []
        watcher = threading.Thread(target=_signal_at_step_3, args=(proc, sig, seen, rest))
        watcher.start()
        runs[sig] = (root, proc, watcher, seen, rest)
    reference(max_train_steps=PREEMPT_STEPS)
    results = {}
    for sig, (root, proc, watcher, seen, rest) in runs.items():
        watcher.join(timeout=240)
        results[sig] = (root, proc.wait(timeout=120), "".join(seen), "".join(rest))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_preemption_saves_at_a_step_boundary_and_resumes_exactly(
    preempted, reference, tiny_sd, shapes_dir, tmp_path, sig, code
):
    root, returned, seen, rest = preempted[sig]
    assert returned == code, "".join(seen.splitlines(keepends=True)[-20:]) + rest[-3000:]
    assert f"stopped by {signal.Signals(sig).name}" in rest
    shutil.copytree(root, tmp_path / "copy")
    raw = _preempt_raw(tiny_sd, shapes_dir, tmp_path / "copy", reference.cache_dir)
    out = Path(raw["output_dir"])
    latest = ckpt.find_latest(out)
    assert latest is not None and 3 <= int(latest.name.split("-")[1]) < PREEMPT_STEPS
    resumed = _trainer(dict(raw, resume_from_checkpoint="latest")).train()
    assert resumed.global_step == PREEMPT_STEPS
    straight = load_file(reference(max_train_steps=PREEMPT_STEPS) / resumed.output_path.name)
    assert same_weights(straight, _weights(resumed))


@pytest.fixture(scope="module")
def killed(tiny_sd, shapes_dir, tmp_path_factory, reference):
    """point -> (root, exit code, stderr) of a real 6-step run (checkpoints every 2 steps, 1 kept)
    that SIGKILLs itself at ``point`` while saving checkpoint-4. The four runs go at once, and
    meanwhile the undisturbed run trains in this process. Read only: a test copies ``root``."""
    base = tmp_path_factory.mktemp("killed")
    procs = {}
    for point in KILL_POINTS:
        root = base / point.replace(":", "_")
        root.mkdir()
        config = _write(root, _kill_raw(tiny_sd, shapes_dir, root, reference.cache_dir))
        procs[point] = (root, _spawn(config, SIMPLETUNER_FAULT=f"{point}@2"))  # die while saving checkpoint-4
    reference(max_train_steps=6)
    results = {}
    for point, (root, proc) in procs.items():
        _, err = proc.communicate(timeout=180)
        results[point] = (root, proc.returncode, err)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(killed, reference, tiny_sd, shapes_dir, tmp_path, point):
    root, returned, err = killed[point]
    assert returned == -signal.SIGKILL, err[-3000:]
    shutil.copytree(root, tmp_path / "copy")
    raw = _kill_raw(tiny_sd, shapes_dir, tmp_path / "copy", reference.cache_dir)
    out = Path(raw["output_dir"])
    latest = ckpt.find_latest(out)
    assert latest is not None and ckpt.is_complete(latest)
    # Until `latest` is rewritten it names checkpoint-2, which retention has not removed.
    assert latest.name == ("checkpoint-4" if point == "checkpoint:latest_written" else "checkpoint-2")
    assert (out / "latest").read_text() == latest.name
    resumed = _trainer(dict(raw, resume_from_checkpoint="latest")).train()
    assert resumed.global_step == 6
    straight = load_file(reference(max_train_steps=6) / resumed.output_path.name)
    assert same_weights(straight, _weights(resumed))
    assert not list(out.glob(".checkpoint-*")), list(out.iterdir())
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-6"]
