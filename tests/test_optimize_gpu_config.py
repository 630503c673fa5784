"""scripts/optimize_gpu_config.py: the seed's flags, run as a script from the checkout, doing what
`simpletuner estimate` does (the same code: it only translates the flags)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "optimize_gpu_config.py"


def _script_module():
    spec = importlib.util.spec_from_file_location("optimize_gpu_config", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python scripts/optimize_gpu_config.py ARGS`` in ``cwd``, with no CUDA device visible."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def cfg(tmp_path, make_config):
    path = tmp_path / "cfg.json"
    path.write_text(
        json.dumps(make_config(train_batch_size=2, gradient_accumulation_steps=4, mixed_precision="no"), indent=2)
        + "\n"
    )
    return path


def test_each_flag_maps_to_its_estimate_flag():
    translate = _script_module().translate
    assert translate(["--auto", "--config-path", "c.json"]) == ["estimate", "--config", "c.json", "--gpu", "auto"]
    assert translate(
        ["--gpu-memory", "24", "--target-effective-batch", "32", "--apply", "--config-path", "c.json"]
    ) == ["estimate", "--config", "c.json", "--gpu-memory", "24", "--target-effective-batch", "32", "--apply"]
    assert translate(["--profile"]) == ["estimate", "--config", "config/config.json", "--profile"]
    # other estimate flags pass through; `--gpu` is not taken for an abbreviation of --gpu-memory
    assert translate(["--config-path", "c.json", "--gpu", "h100", "--safety-margin", "0.75", "--json"]) == [
        "estimate",
        "--config",
        "c.json",
        "--gpu",
        "h100",
        "--safety-margin",
        "0.75",
        "--json",
    ]
    with pytest.raises(SystemExit) as info:
        translate(["--auto", "--gpu", "h100"])
    assert info.value.code == 2


def test_it_runs_simpletuner_estimate_and_returns_its_exit_code(monkeypatch, cfg, capsys):
    import simpletuner.cli

    seen = []
    monkeypatch.setattr(simpletuner.cli, "main", lambda argv: seen.append(argv) or 1)
    assert _script_module().main(["--gpu-memory", "8", "--config-path", str(cfg)]) == 1  # "does not fit", passed on
    assert seen == [["estimate", "--config", str(cfg), "--gpu-memory", "8"]]


def test_gpu_memory_target_batch_and_apply_write_the_estimates_plan(cfg, tmp_path):
    original = cfg.read_text()
    done = run_script(
        "--gpu-memory",
        "24",
        "--target-effective-batch",
        "16",
        "--apply",
        "--config-path",
        "cfg.json",
        "--json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (
        "running: simpletuner estimate --config cfg.json --gpu-memory 24 --target-effective-batch 16 --apply --json"
        in done.stderr
    )
    out = json.loads(done.stdout)
    plan = out["plan"]
    assert out["machine"] == {"kind": "generic", "usable_bytes": 24 << 30, "hardware": None}
    written = json.loads(cfg.read_text())
    assert (written["train_batch_size"], written["gradient_accumulation_steps"]) == (
        plan["micro_batch_size"],
        plan["gradient_accumulation_steps"],
    )
    assert written["train_batch_size"] * written["gradient_accumulation_steps"] == 16
    assert written["train_batch_size"] != 2, "the plan changed the micro-batch, so something was written"
    assert (tmp_path / "cfg.json.backup").read_text() == original
    assert out["applied"]["backup"] == "cfg.json.backup" and "train_batch_size" in out["applied"]["changed"]


def test_auto_detects_this_machine_and_other_flags_pass_through(cfg, tmp_path):
    done = run_script(
        "--auto", "--target-effective-batch", "4", "--safety-margin", "0.8", "--config-path", str(cfg), cwd=tmp_path
    )
    assert (
        f"running: simpletuner estimate --config {cfg} --gpu auto --target-effective-batch 4 --safety-margin 0.8"
        in done.stderr
    )
    # detection ran and found no CUDA device (none is visible), so there is no memory to plan for: bad input
    assert done.returncode == 2
    assert "auto-config needs a GPU's memory to plan for, and this machine has no CUDA device" in done.stderr


def test_profile_is_estimates_profile(cfg, tmp_path):
    done = run_script("--profile", "--config-path", str(cfg), cwd=tmp_path)
    assert done.returncode == 2
    assert "running: simpletuner estimate --config" in done.stderr and "--profile" in done.stderr
    assert "--profile runs real training steps and needs a CUDA GPU" in done.stderr


def test_missing_default_config_says_to_pass_config_path(tmp_path):
    done = run_script("--auto", cwd=tmp_path)
    assert done.returncode == 2
    assert "no --config-path given, and the default config/config.json does not exist" in done.stderr
