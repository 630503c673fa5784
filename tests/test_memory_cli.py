"""`simpletuner estimate` end to end on the tiny SD model: table, GPUs, auto-config, --apply, --profile."""

from __future__ import annotations

import json
import os

import pytest
import torch

from simpletuner.cli import main
from simpletuner.hardware import machine as hardware


@pytest.fixture
def cfg_file(tmp_path, make_config):
    """The tiny config as a file with a layout of its own (inline object, 4-space indent)."""
    raw = make_config(train_batch_size=2, mixed_precision="no")
    text = json.dumps(raw, indent=4).replace(
        json.dumps(raw["cache_config"], indent=4).replace("\n", "\n    "), json.dumps(raw["cache_config"])
    )
    path = tmp_path / "cfg.json"
    path.write_text(text)
    return path


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine without a CUDA device, whatever it has."""
    real = hardware.detect_hardware
    monkeypatch.setattr(hardware, "detect_hardware", lambda: real(runtime=_NoCuda()))


class _NoCuda:
    def cuda_available(self):
        return False


def test_estimate_without_a_gpu_prints_the_table_without_headroom(cfg_file, capsys, no_gpu):
    assert main(["estimate", "--config", str(cfg_file)]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device here" in out
    for row in ("weights", "gradients", "optimizer state", "activations", "batch data", "framework overhead", "total"):
        assert f"\n{row} " in out
    assert "\nheadroom" not in out and "\nusable" not in out


def test_estimate_on_a_named_gpu_as_json(cfg_file, capsys):
    assert main(["estimate", "--config", str(cfg_file), "--gpu", "h100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["machine"]["kind"] == "table" and data["machine"]["hardware"]["gpu_spec"] == "H100 SXM"
    assert data["fits"] is True and data["headroom_bytes"] == data["machine"]["usable_bytes"] - data["total_bytes"]
    assert data["estimate"]["micro_batch_size"] == 2


def test_unknown_gpu_lists_the_known_ones(cfg_file, capsys):
    assert main(["estimate", "--config", str(cfg_file), "--gpu", "rtx9999"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU 'rtx9999'" in err and "H100 SXM" in err and "GB10" in err and "--gpu-memory" in err


def test_config_that_cannot_fit_names_the_dominant_part(cfg_file, capsys):
    assert main(["estimate", "--config", str(cfg_file), "--gpu-memory", "0.001", "--target-effective-batch", "1"]) == 1
    err = capsys.readouterr().err
    assert "does not fit: even micro-batch 1 with gradient checkpointing" in err
    assert "largest part is framework overhead" in err and "too small to train on" in err

    assert main(["estimate", "--config", str(cfg_file), "--gpu-memory", "0.5"]) == 1  # the config as it is
    out = capsys.readouterr().out
    assert "does not fit: micro-batch 2 needs" in out and "above the 0.50 GiB usable" in out


def test_auto_config_needs_a_memory_size(cfg_file, capsys, no_gpu):
    assert main(["estimate", "--config", str(cfg_file), "--target-effective-batch", "4"]) == 2
    assert "pass --gpu NAME" in capsys.readouterr().err


def test_apply_writes_backup_and_diff_and_keeps_everything_else(cfg_file, capsys):
    original = cfg_file.read_text()
    assert (
        main(["estimate", "--config", str(cfg_file), "--gpu", "h100", "--target-effective-batch", "4", "--apply"]) == 0
    )
    out = capsys.readouterr().out
    backup = cfg_file.with_name("cfg.json.backup")
    assert backup.read_text() == original
    assert (
        "train_batch_size: 2 -> 4" in out
        and '-    "train_batch_size": 2,' in out
        and '+    "train_batch_size": 4,' in out
    )
    new = cfg_file.read_text()
    assert new == original.replace('"train_batch_size": 2', '"train_batch_size": 4')  # nothing else moved
    old_raw, new_raw = json.loads(original), json.loads(new)
    assert list(new_raw) == list(old_raw) and {**old_raw, "train_batch_size": 4} == new_raw

    assert (
        main(["estimate", "--config", str(cfg_file), "--gpu", "h100", "--target-effective-batch", "8", "--apply"]) == 0
    )
    capsys.readouterr()
    assert backup.read_text() == original, "an existing backup is never overwritten"
    assert cfg_file.with_name("cfg.json.backup.1").read_text() == new
    # 12 images in 3 buckets: the largest holds 4, so 8 splits as 4 x 2 (train refuses a micro-batch of 8)
    assert {k: json.loads(cfg_file.read_text())[k] for k in ("train_batch_size", "gradient_accumulation_steps")} == {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,
    }


def test_apply_refuses_a_read_only_file(cfg_file, capsys):
    original = cfg_file.read_bytes()
    cfg_file.chmod(0o444)
    try:
        assert main(["estimate", "--config", str(cfg_file), "--gpu", "h100", "--apply"]) == 2
    finally:
        cfg_file.chmod(0o644)
    assert "read-only (mode 0444)" in capsys.readouterr().err
    assert cfg_file.read_bytes() == original and not list(cfg_file.parent.glob("cfg.json.*"))


def test_apply_failing_to_write_leaves_the_original(cfg_file, monkeypatch):
    from simpletuner.memory.apply import ApplyError, apply_updates

    original = cfg_file.read_bytes()

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(ApplyError, match="Permission denied; the original is unchanged"):
        apply_updates(cfg_file, {"train_batch_size": 4, "gradient_checkpointing": True})
    assert cfg_file.read_bytes() == original
    assert sorted(p.name for p in cfg_file.parent.iterdir() if p.name.startswith((".cfg", "cfg"))) == ["cfg.json"]


def test_apply_inserts_missing_keys_next_to_related_ones(cfg_file):
    from simpletuner.memory.apply import apply_updates

    result = apply_updates(cfg_file, {"gradient_accumulation_steps": 4, "gradient_checkpointing": True})
    keys = list(json.loads(cfg_file.read_text()))
    assert keys[keys.index("train_batch_size") + 1] == "gradient_accumulation_steps"
    assert keys[keys.index("mixed_precision") + 1] == "gradient_checkpointing"
    assert '\n    "gradient_checkpointing": true' in cfg_file.read_text()  # the file's own indentation
    assert result.changed == {"gradient_accumulation_steps": (None, 4), "gradient_checkpointing": (None, True)}
    assert apply_updates(cfg_file, {"gradient_checkpointing": True}).backup is None  # nothing to change


def test_apply_with_overrides_is_refused(cfg_file, capsys):
    assert main(["estimate", "--config", str(cfg_file), "--gpu", "h100", "--apply", "--set", "resolution=128"]) == 2
    assert "--set changes would not be written" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_profile_without_a_gpu_says_so(cfg_file, capsys):
    assert main(["estimate", "--config", str(cfg_file), "--profile"]) == 2
    assert "--profile runs real training steps and needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_profile_on_a_gpu_compares_estimate_and_measurement(cfg_file, capsys):
    assert main(["estimate", "--config", str(cfg_file), "--profile", "--profile-steps", "2", "--json"]) == 0
    profile = json.loads(capsys.readouterr().out)["profile"]
    assert profile["steps"] == 2 and profile["measured_allocated"] > 0
    assert profile["measured_reserved"] >= profile["measured_allocated"]


def test_profile_runs_the_trainers_steps_in_a_throwaway_output_dir(tmp_path, make_config, monkeypatch):
    """The --profile plumbing on CPU, with a fake torch.cuda giving the peak figures."""
    import types

    from simpletuner.cli import profile
    from simpletuner.configuration import load_config
    from simpletuner.memory.estimator import GiB, estimate_memory

    class FakeCuda:
        OutOfMemoryError = torch.cuda.OutOfMemoryError

        def __init__(self):
            self.calls = []
            self.values = {
                "is_available": True,
                "max_memory_allocated": GiB // 4,
                "max_memory_reserved": GiB // 2,
                "mem_get_info": (GiB, 2 * GiB),
                "memory_reserved": GiB // 2,
                "get_device_name": "Fake GPU",
            }

        def __getattr__(self, name):
            return lambda *args, **kwargs: self.calls.append(name) or self.values.get(name)

    cuda = FakeCuda()
    monkeypatch.setattr(profile, "torch", types.SimpleNamespace(cuda=cuda))
    path = tmp_path / "cfg.json"
    path.write_text(
        json.dumps(
            make_config(
                gradient_accumulation_steps=3,
                validation_prompt="a red square",
                validation_steps=1,
                checkpointing_steps=1,
            )
        )
    )
    breakdown = estimate_memory(load_config(path).config)
    result = profile.profile_training(str(path), [], breakdown, steps=2)
    assert cuda.calls.index("reset_peak_memory_stats") < cuda.calls.index("max_memory_allocated")
    assert (result.measured_allocated, result.measured_reserved, result.measured_outside_allocator) == (
        GiB // 4,
        GiB // 2,
        GiB // 2,
    )
    assert result.estimated_total == breakdown.total and result.measured_total == GiB
    assert "Fake GPU" in result.table()
    assert not (tmp_path / "output").exists(), "no checkpoints, validation images or weights in the config's output_dir"


def test_machine_detected_named_generic_and_shared():
    from fake_cuda import FakeRuntime

    from simpletuner.memory.report import resolve_machine

    busy = FakeRuntime()
    busy.free_bytes = busy.info.total_bytes // 4
    detected = resolve_machine("auto", None, detect=lambda: hardware.detect_hardware(runtime=busy))
    assert detected.kind == "detected" and detected.usable_bytes == detected.hardware.usable_memory_bytes
    assert any("something else holds GPU memory" in line for line in detected.lines)
    assert any("plan for the HBM" in line for line in detected.lines)  # a GH200-like device

    generic = resolve_machine("auto", 24)
    assert (generic.kind, generic.usable_bytes, generic.hardware) == ("generic", 24 * hardware.GIB, None)
    gb10 = resolve_machine("gb10", None)
    assert gb10.kind == "table" and any("shared memory" in line for line in gb10.lines)
    assert resolve_machine("a100", 80).usable_bytes == 80 * hardware.GIB
    with pytest.raises(ValueError, match="positive"):
        resolve_machine("auto", 0)


def test_an_internal_error_exits_70_with_the_traceback_and_what_to_report(cfg_file, capsys, monkeypatch):
    """A bug (here the estimator raising AttributeError, as the Flux crash did) must not exit 1, which
    reads as "does not fit", nor 2 ("bad input")."""
    from simpletuner.exit_codes import INTERNAL_ERROR
    from simpletuner.memory import autoconfig

    def broken(*args, **kwargs):
        raise AttributeError("'_AutocastForward' object has no attribute 'config'")

    monkeypatch.setattr(autoconfig, "estimate_memory", broken)
    assert main(["estimate", "--config", str(cfg_file), "--gpu", "h100"]) == INTERNAL_ERROR == 70
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert "internal error in `simpletuner estimate` (AttributeError:" in err
    assert "this is a bug in simpletuner" in err and "Please report it" in err and "Exit code 70" in err


def test_fork_only_alloc_conf_keys_stop_the_estimate(cfg_file, capsys, monkeypatch):
    from simpletuner.memory import autoconfig

    monkeypatch.setenv(
        "PYTORCH_CUDA_ALLOC_CONF", "use_uvm:True,uvm_oversubscription_ratio:1.5,expandable_segments:True"
    )
    monkeypatch.setattr(
        autoconfig, "estimate_memory", lambda *a, **k: pytest.fail("estimated despite the bad variable")
    )
    assert main(["estimate", "--config", str(cfg_file), "--gpu", "h100"]) == 2
    err = capsys.readouterr().err.splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 2 and "`use_uvm`" in errors[0] and "`uvm_oversubscription_ratio`" in errors[1]
    assert all('Fix: export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"' in line for line in errors)


def test_unknown_alloc_conf_keys_warn_and_the_estimate_goes_on(cfg_file, capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,fancy_new_knob:4")
    assert main(["estimate", "--preset", "discrete_24gb", "--config", str(cfg_file)]) == 0  # checked with any --config
    out, err = capsys.readouterr()
    assert "train_batch_size: config 2, preset 4" in out
    assert "warning: PYTORCH_CUDA_ALLOC_CONF sets `fancy_new_knob`" in err and "error" not in err


def test_estimate_uses_the_precision_train_would_use_and_says_where_it_came_from(
    tmp_path, make_config, capsys, monkeypatch, no_gpu
):
    raw = make_config(train_batch_size=2)
    raw.pop("mixed_precision", None)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert main(["estimate", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "precision: no (fp32): the config leaves mixed_precision to the launch" in out
    assert "--set mixed_precision=bf16" in out and "mixed precision no:" in out

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert main(["estimate", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "precision: bf16 (from the environment variable ACCELERATE_MIXED_PRECISION=bf16" in out
    assert "mixed precision bf16:" in out

    assert main(["estimate", "--config", str(path), "--set", "mixed_precision=no"]) == 2
    assert (
        "says 'no' but the environment variable ACCELERATE_MIXED_PRECISION=bf16 says 'bf16'" in capsys.readouterr().err
    )


def test_estimate_imports_only_what_it_uses(cfg_file, tmp_path):
    """Presets and a refused config are answered by the configuration layer alone (no torch, no model library);
    an estimate builds the denoiser from its config, so its weights are never read (here they are not weights at
    all), and neither a pipeline, the trainer nor torchao is imported."""
    import shutil
    import subprocess
    import sys

    raw = json.loads(cfg_file.read_text())
    model = tmp_path / "model"
    shutil.copytree(raw["pretrained_model_name_or_path"], model)
    (model / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"not weights")
    good, bad = tmp_path / "estimate.json", tmp_path / "bad.json"
    good.write_text(json.dumps({**raw, "pretrained_model_name_or_path": str(model)}))
    bad.write_text(json.dumps({**raw, "resolution": "large"}))
    probe = (
        "import json, sys\n"
        "from simpletuner.cli import main\n"
        "loaded = lambda *names: sorted(n for n in names if n in sys.modules)\n"
        f"good, bad = {str(good)!r}, {str(bad)!r}\n"
        "codes = [main(['estimate', '--list-presets']), main(['estimate', '--preset', 'discrete_24gb']),\n"
        "         main(['estimate', '--preset', 'discrete_24gb', '--config', good]),\n"
        "         main(['estimate', '--config', bad])]\n"
        "before = loaded('torch', 'diffusers', 'transformers', 'simpletuner.hardware.runtime')\n"
        "codes.append(main(['estimate', '--config', good, '--gpu', 'h100']))\n"
        "after = loaded('torchao', 'simpletuner.training.trainer')\n"
        "after += sorted(m for m in sys.modules if m.startswith('diffusers.pipelines.'))\n"
        "print(json.dumps({'codes': codes, 'before': before, 'after': after}))\n"
    )
    env = {**os.environ, "SIMPLETUNER_ESTIMATE_CACHE": "off"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["codes"] == [0, 0, 0, 2, 0], done.stderr
    assert "resolution" in done.stderr  # the refusal names the bad key
    assert result["before"] == [], "presets and a refused config need no torch, hardware probe or model library"
    assert result["after"] == []
