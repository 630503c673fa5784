"""Quiet by default (no GH200 chatter or gh200_runtime.json in an ordinary run, no torchao unless
used, no torchvision notices, no "0.00 TFLOPS"), and names a user can trust."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from simpletuner.configuration import load_config
from simpletuner.gh200 import uvm
from simpletuner.gh200.wiring import RUNTIME_FILE, configure_runtime, gh200_layer_requests
from simpletuner.models.library_probes import TRANSFORMERS_IMPORT_LOGGER, TorchvisionFallbackFilter
from simpletuner.state import StateTracker
from simpletuner.training.accumulation import build_accumulation
from simpletuner.training.metrics import log_line

ROOT = Path(__file__).resolve().parents[1]


def _state(tmp_path, raw) -> StateTracker:
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    loaded = load_config(str(path))
    return StateTracker(loaded.config, loaded.raw)


@pytest.fixture
def no_hint_env(monkeypatch):
    monkeypatch.delenv(uvm.ENV_VAR, raising=False)
    monkeypatch.delenv(uvm.ENV_ALIAS, raising=False)
    uvm._reset_for_tests()
    yield
    uvm._reset_for_tests()


def test_ordinary_run_says_one_debug_line_about_gh200_and_writes_no_file(make_config, tmp_path, no_hint_env, caplog):
    state = _state(tmp_path, make_config())
    out = tmp_path / "out"
    with caplog.at_level(logging.DEBUG, logger="simpletuner"):
        policy = build_accumulation(state.config, num_processes=1)
        decided = configure_runtime(
            state.config, num_processes=1, is_main_process=True, output_dir=out, accumulation=policy.state_dict()
        )
    assert policy.state_dict() == decided.accumulation == {"kind": "fixed", "steps": 1}
    assert not (out / RUNTIME_FILE).exists()
    assert decided.uvm_hints_active is False  # still decided for the run
    about_gh200 = [
        r for r in caplog.records if "gh200" in r.getMessage().lower() or "unified" in r.getMessage().lower()
    ]
    assert [(r.levelno, r.getMessage()) for r in about_gh200] == [
        (
            logging.DEBUG,
            "GH200 unified-memory hints are off: off by default "
            f"(set {uvm.ENV_VAR}=1 or gh200_optimizations.enable_uvm_hints)",
        )
    ]


@pytest.mark.parametrize(
    "overrides, env, named",
    [
        (
            {"cache_config": {"vae_cache_type": "memory", "persistent_cache": False}},
            None,
            "cache_config.vae_cache_type=memory",
        ),
        (
            {"cache_config": {"text_cache_type": "unified_memory", "persistent_cache": False}},
            None,
            "cache_config.text_cache_type=unified_memory",
        ),
        ({"in_memory_dataset": True}, None, "datasets[0].type=in_memory"),
        ({"gh200_optimizations": {"enable_uvm_hints": False}}, None, "gh200_optimizations.enable_uvm_hints=false"),
        (
            {
                "gh200_optimizations": {
                    "enable_batch_size_rampup": True,
                    "initial_effective_batch_size": 2,
                    "target_effective_batch_size": 4,
                    "batch_rampup_steps": 2,
                }
            },
            None,
            "gh200_optimizations.enable_batch_size_rampup=true",
        ),
        ({}, (uvm.ENV_VAR, "0"), uvm.ENV_VAR),
        ({}, (uvm.ENV_ALIAS, "1"), uvm.ENV_ALIAS),
    ],
)
def test_configured_gh200_layer_writes_runtime_json(
    make_config, tmp_path, no_hint_env, monkeypatch, overrides, env, named
):
    raw = make_config()
    if overrides.pop("in_memory_dataset", False):
        raw["datasets"][0]["type"] = "in_memory"
    for key, value in overrides.items():
        raw[key] = {**raw.get(key, {}), **value}
    if env is not None:
        monkeypatch.setenv(*env)
    state = _state(tmp_path, raw)
    assert named in gh200_layer_requests(state.config)
    decided = configure_runtime(
        state.config,
        num_processes=1,
        is_main_process=True,
        output_dir=tmp_path / "out",
        accumulation=build_accumulation(state.config, num_processes=1).state_dict(),
    )
    on_disk = json.loads((tmp_path / "out" / RUNTIME_FILE).read_text())
    assert on_disk["accumulation"] == decided.accumulation


_IMPORTS = r"""
import sys
import simpletuner.models  # what every model-loading path imports first
from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPImageProcessor
import peft.import_utils
print("LOADED", sorted(m for m in ("torchao", "optimum.quanto", "lycoris") if m in sys.modules))
print("PEFT_SEES_TORCHAO", peft.import_utils.is_torchao_available())
print("NOW-IMPORTING-TORCHAO", file=sys.stderr, flush=True)
from simpletuner.models.library_probes import torchao_in_use
import torchao.quantization  # a torchao base_model_precision still finds it
torchao_in_use()
print("PEFT_SEES_TORCHAO_WHEN_USED", peft.import_utils.is_torchao_available())
"""


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed: nothing to hide")
def test_model_libraries_load_without_torchao_or_torchvision_notices():
    out = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout
    assert "PEFT_SEES_TORCHAO False" in out.stdout
    assert "PEFT_SEES_TORCHAO_WHEN_USED True" in out.stdout
    before_torchao = out.stderr.split("NOW-IMPORTING-TORCHAO")[0]
    assert (
        "torchao" not in before_torchao
    )  # no "Failed to load .../torchao/_C_mxfp8...", no "Unable to import `torchao`"
    assert "requires torchvision" not in out.stderr


def test_torchvision_filter_drops_only_the_fallback_notice():
    def record(message):
        return logging.LogRecord(TRANSFORMERS_IMPORT_LOGGER, logging.WARNING, __file__, 1, message, None, None)

    keep = TorchvisionFallbackFilter().filter
    assert not keep(
        record(
            "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
            "`CLIPImageProcessorPil` for backward compatibility."
        )
    )
    assert keep(record("Could not import module 'CLIPTextModel'"))
    assert keep(record("`VideoProcessor` requires torchvision"))  # any other torchvision message stays
    assert any(isinstance(f, TorchvisionFallbackFilter) for f in logging.getLogger(TRANSFORMERS_IMPORT_LOGGER).filters)


_WINDOW = {"loss": 0.5, "lr": 1e-4, "samples_per_s": 50.0, "step_time_s": 0.07, "data_wait_share": 0.01}


def test_log_line_shows_tflops_for_gpu_windows_only():
    cpu = log_line({**_WINDOW, "tflops": 0.0042})  # no MFU, no CUDA peak memory: a CPU window
    assert "TFLOPS" not in cpu and cpu.startswith("loss 0.5000")
    assert "12.30 TFLOPS, MFU 1.2%" in log_line({**_WINDOW, "tflops": 12.3, "mfu": 0.0124})
    assert "3.10 TFLOPS, peak 2.00 GiB" in log_line({**_WINDOW, "tflops": 3.1, "peak_memory_gib": 2.0})  # peak unknown


# --- names a user can trust (issue 12, item 9) ---------------------------------------------------------

_FROM_INDEX = re.compile(r"pip install (--force-reinstall |-U |--upgrade )*['\"]?simpletuner\b(?!-gh200)")


def test_distribution_name_is_not_the_other_projects_and_no_install_line_points_there():
    import tomllib

    from simpletuner.cli import DISTRIBUTION

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION == "simpletuner-gh200"
    assert project["scripts"]["simpletuner"] == "simpletuner.cli:main"  # the command keeps its name
    texts = [
        ROOT / "README.md",
        *sorted((ROOT / "documentation").glob("*.md")),
        *sorted((ROOT / "simpletuner").rglob("*.py")),
        *sorted((ROOT / "config").rglob("*.json")),  # a preset's `why` is printed by `estimate --preset`
    ]
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in texts
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "simpletuner[" in line or _FROM_INDEX.search(line)
    ]
    assert offenders == []


def test_version_flag_names_the_distribution(capsys):
    from simpletuner import __version__, cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    # Installed under the new name (a wheel): its metadata; here (a checkout): the package's own version.
    assert out in (
        f"simpletuner-gh200 {importlib.metadata.version('simpletuner-gh200')}"
        if _installed("simpletuner-gh200")
        else f"simpletuner-gh200 {__version__} (source)",
    )


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_run_outputs_checkpoints_and_caches_are_0644(make_config, tmp_path, umask_022):
    from simpletuner.training.trainer import Trainer

    raw = make_config(max_train_steps=2, checkpointing_steps=1, validation_prompt=None)
    state = _state(tmp_path, raw)
    Trainer(state).train()
    files = [
        p
        for root in (Path(raw["output_dir"]), Path(raw["cache_config"]["cache_dir"]))
        for p in root.rglob("*")
        if p.is_file()
    ]
    assert any(p.name == "pytorch_lora_weights.safetensors" for p in files)
    assert any(p.name == "trainable.safetensors" for p in files)
    assert any(p.suffix == ".safetensors" and Path(raw["cache_config"]["cache_dir"]) in p.parents for p in files)
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert {k: v for k, v in modes.items() if v != "0o644"} == {}


def test_ordinary_permissions_respect_the_umask(tmp_path):
    import torch
    from safetensors.torch import save_file

    from simpletuner.file_modes import ordinary_permissions

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(1)}, str(path))
    old = os.umask(0o027)
    try:
        ordinary_permissions(tmp_path)  # a folder: every file under it
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


def test_diagnose_exits_0_here_and_3_when_a_verdict_fails(capsys, monkeypatch):
    from fake_cuda import FakeRuntime, gh200_info

    from simpletuner.cli import diagnose
    from simpletuner.gh200 import diagnostic
    from simpletuner.hardware.host import nvidia_gpu_present
    from simpletuner.hardware.runtime import use_runtime

    for name in ("PYTORCH_CUDA_ALLOC_CONF", uvm.ENV_VAR, uvm.ENV_ALIAS):
        monkeypatch.delenv(name, raising=False)
    host_has_gpu = nvidia_gpu_present()
    code = diagnose.main(["--json"])
    summary = json.loads(capsys.readouterr().out)
    if not host_has_gpu and not summary["device"]:  # this CPU machine: GPU verdicts do not apply
        assert code == 0
        assert {v["status"] for v in summary["verdicts"]} == {"not applicable"}
    # The same CUDA-less report on a host whose driver lists a GPU: PyTorch cannot see it, a failure.
    failing = diagnostic.verdicts({**summary, "host": {**summary["host"], "nvidia_gpu_present": True}})
    assert summary["device"] or {v["status"] for v in failing} == {"failed"}

    with use_runtime(FakeRuntime(info=gh200_info())):
        assert diagnose.main([]) == 0  # a ready GH200; hints unset is advice, not a failure
        assert "[tip] SIMPLETUNER_GH200_UVM_HINTS=unset" in capsys.readouterr().out
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "use_uvm:True")  # a key stock PyTorch rejects
        assert diagnose.main([]) == 3
        assert "[--] PYTORCH_CUDA_ALLOC_CONF has keys stock PyTorch rejects: use_uvm" in capsys.readouterr().out
