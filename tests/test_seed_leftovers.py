"""What the seed documents (shared/seeds) do that a user will try here (issue 29, item 6).

Each test does what a seed does: its grep, its call, its flag, its GPU, its config key, and checks
that it works here or is answered with what replaces it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _minimal_raw(tmp_path: Path) -> dict:
    """A config that validates without model files (``check_files=False``)."""
    (tmp_path / "data").mkdir(exist_ok=True)
    return {
        "pretrained_model_name_or_path": str(tmp_path / "model"),
        "model_family": "sd",
        "output_dir": str(tmp_path / "out"),
        "max_train_steps": 10,
        "datasets": [{"id": "d", "type": "local", "instance_data_dir": str(tmp_path / "data")}],
    }


# --- seed 004: `tail -f model_training.log | grep mfu` -----------------------------------------------
def test_the_log_line_carries_the_lower_case_mfu_key():
    """Seed 004 (``grep mfu``, its lines read ``mfu 15.2%``) greps lower case; the line said only ``MFU``."""
    from simpletuner.training.metrics import log_line

    line = log_line(
        {"loss": 0.5, "lr": 1e-4, "samples_per_s": 50.0, "step_time_s": 0.07, "data_wait_share": 0.0, "tflops": 12.3}
        | {"mfu": 0.0124}
    )
    assert "12.30 TFLOPS, MFU 1.2%" in line  # as before: the console's form
    assert "mfu=0.0124" in line  # metrics.jsonl's key and value, for `grep mfu training.log`


# --- seed 001: `torch.cuda.memory_stats()['uvm.stage']` ... ------------------------------------------
def test_the_diagnostic_says_the_forks_uvm_statistics_do_not_exist_and_what_replaces_them(capsys):
    """Seed 001 monitors ``stats['uvm.stage']``, ``['uvm.light_reclamations']``, ``['uvm.hard_reclamations']``
    of ``torch.cuda.memory_stats()``: keys of the fork's patched PyTorch. The diagnostic's managed-pool
    section, where a GH200 user looks for unified-memory figures, says so and names what stands in for them."""
    import json

    import torch
    from fake_cuda import FakeRuntime

    from simpletuner.cli.diagnose import main
    from simpletuner.hardware.runtime import use_runtime

    assert "uvm.light_reclamations" not in torch.cuda.memory_stats()  # stock PyTorch (CPU build: empty)
    with use_runtime(FakeRuntime()):
        assert main([]) == 0
        report = capsys.readouterr().out
        assert main(["--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
    pool = report.split("== managed pool ==", 1)[1].split("==", 1)[0]
    for word in ("uvm.stage", "uvm.light_reclamations", "uvm.hard_reclamations", "do not exist on stock PyTorch"):
        assert word in pool
    for replacement in ("managed_pool_gib", "num_alloc_retries", "num_ooms", "--cuda-um-gpu-page-faults=true"):
        assert replacement in pool
    assert "uvm.hard_reclamations" in summary["managed_pool"]["fork_uvm_stats"]


# --- seed 003: `optimize_gpu_config.py --auto` --------------------------------------------------------
def test_estimate_accepts_auto_as_the_seeds_script_does(tmp_path, capsys):
    """Seed 003 runs ``optimize_gpu_config.py --auto`` (detect the GPU); ``simpletuner estimate --auto`` was
    "unrecognized arguments". It is ``--gpu auto`` (the default); with ``--gpu NAME`` it is a contradiction."""
    from simpletuner.cli import main

    assert main(["estimate", "--auto", "--list-presets"]) == 0
    assert "gb10_optimized" in capsys.readouterr().out
    assert main(["estimate", "--auto", "--gpu", "h100", "--list-presets"]) == 2
    assert "--auto means --gpu auto: drop one of --auto and --gpu h100" in capsys.readouterr().err


# --- seed 003's card: "Quadro RTX 6000 (24 GB) - Current Setup" ---------------------------------------
@pytest.mark.parametrize("name", ["Quadro RTX 6000", "quadro-rtx-6000", "rtx6000"])
def test_the_quadro_rtx_6000_is_in_the_gpu_table(name):
    """nvidia-smi names it "Quadro RTX 6000" (seed 003); it was missing, so MFU and `--gpu` did not know it."""
    from simpletuner.hardware.gpus import lookup_gpu, resolve_gpu_name

    spec = resolve_gpu_name(name)
    assert spec.name == "Quadro RTX 6000" and spec.memory_gb == (24,) and spec.compute_capability == (7, 5)
    # Turing: FP16 tensor cores (full rate with FP32 accumulate on a Quadro), no BF16, no TF32 (datasheet figures)
    assert (spec.bf16_tflops, spec.fp16_tflops, spec.tf32_tflops, spec.fp32_tflops) == (None, 130.5, None, 16.3)
    assert lookup_gpu("NVIDIA RTX 6000 Ada Generation").name == "RTX 6000 Ada"  # the Ada card stays itself


# --- seed 004's `slm_config`: enable_amp / amp_dtype ---------------------------------------------------
def test_seed_004s_amp_keys_point_to_mixed_precision(tmp_path):
    """Seed 004's recipes set ``enable_amp: true`` and ``amp_dtype: "bf16"``: an error names ``mixed_precision``
    (its ``enable_tf32`` and ``enable_compile`` are ours and are accepted as they are)."""
    from simpletuner.configuration import ConfigError, validate_config

    raw = {
        **_minimal_raw(tmp_path),
        "enable_tf32": True,
        "enable_compile": False,
        "enable_amp": True,
        "amp_dtype": "bf16",
    }
    with pytest.raises(ConfigError) as err:
        validate_config(raw, check_files=False)
    problems = {p.split(":", 1)[0]: p for p in err.value.problems}
    assert set(problems) == {"enable_amp", "amp_dtype"}, err.value.problems
    assert 'is `mixed_precision: "bf16"`' in problems["enable_amp"] and "use it instead" in problems["enable_amp"]
    assert "use `mixed_precision` instead" in problems["amp_dtype"]
    del raw["enable_amp"], raw["amp_dtype"]
    assert validate_config({**raw, "mixed_precision": "bf16"}, check_files=False).mixed_precision == "bf16"


# --- seed 002: "use `StateTracker.delete_cache_files()`" ----------------------------------------------
def test_delete_cache_files_works_called_on_the_class_as_the_seed_does(tmp_path, monkeypatch, caplog):
    """Seed 002 cleans up with ``StateTracker.delete_cache_files()`` on the class: a TypeError (missing
    ``self``). On the class it removes the caches of every run of this process whose tracker is alive; on a
    tracker, only that run's (two runs in one process never touch each other's caches that way)."""
    import logging
    import weakref

    from simpletuner import state as state_module
    from simpletuner.configuration import validate_config
    from simpletuner.state import StateTracker

    monkeypatch.setattr(state_module, "_LIVE", weakref.WeakSet())  # only this test's runs
    raw = _minimal_raw(tmp_path)
    config = validate_config(raw, check_files=False)
    first, second = StateTracker(config, raw), StateTracker(config, raw)
    folders = [tmp_path / "cache" / name for name in ("a_vae", "a_text", "b_vae")]
    for folder in folders:
        folder.mkdir(parents=True)
        (folder / "shard-0.safetensors").write_bytes(b"x")
    first.register_cache_dir(folders[0])
    first.register_cache_dir(folders[1])
    second.register_cache_dir(folders[2])

    assert sorted(first.delete_cache_files()) == sorted(folders[:2]) and folders[2].exists()  # a run's own
    first.register_cache_dir(folders[0])
    folders[0].mkdir()
    assert sorted(StateTracker.delete_cache_files()) == [folders[0], folders[2]]  # the seed's call
    assert not any(folder.exists() for folder in folders)

    del first, second
    with caplog.at_level(logging.WARNING, logger="simpletuner.state"):
        assert StateTracker.delete_cache_files() == []  # no run alive: nothing to remove, and it says where to look
    assert "simpletuner cache clear --config" in caplog.text
