"""Device detection with the real cuda-bindings package: a bindings / driver mismatch is a reason, never a
traceback at start.

This machine has no NVIDIA driver, so every device call of the real bindings returns a CUDA error
(``cudaErrorInsufficientDriver``), as it does where cuda-bindings 13.x meets a CUDA-12 driver. PyTorch is
made to report a CUDA device (the one thing this machine cannot have); everything below it is real:
the bindings, the runtime, the diagnostic, the trainer's runtime wiring and hardware detection.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from simpletuner.hardware import runtime as runtime_module
from simpletuner.hardware.cuda_versions import bindings_error_reason, bindings_requirement, install_hint
from simpletuner.hardware.runtime import CudaBindingsRuntime, use_runtime

cuda_bindings = pytest.importorskip("cuda.bindings", reason="cuda-bindings is in the test extra")

GIB = 1 << 30


@pytest.fixture
def cuda_torch(monkeypatch):
    """PyTorch reporting one CUDA 12.8 device (an H100), as a CUDA build on a GPU machine would."""
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * GIB)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu128")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * GIB, 80 * GIB))


def test_the_real_bindings_report_errors_here():
    """The premise: the installed bindings load, and a device call returns an error rather than raising."""
    from cuda.bindings import runtime as rt

    err, _value = rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrManagedMemory, 0)
    assert err != rt.cudaError_t.cudaSuccess


def test_no_driver_is_a_reason_and_device_info_does_not_raise(cuda_torch):
    rt = CudaBindingsRuntime()
    reason = rt.unavailable_reason()
    assert reason.startswith(f"cuda-bindings {cuda_bindings.__version__} finds no NVIDIA driver")
    assert "cudaErrorInsufficientDriver" in reason
    info = rt.device_info()
    assert info.problem == reason and not info.managed_memory and not info.unified
    assert info.kind.startswith("unknown (the device attributes are unreadable")
    versions = rt.versions()
    assert versions["cuda_bindings"] == cuda_bindings.__version__ and versions["driver"] is None
    assert rt.routing_problem() == f"managed memory is unavailable: {reason}"


@pytest.fixture
def cuda12_driver(cuda_torch, monkeypatch):
    """A CUDA 12.4 driver (r550) under the installed cuda-bindings 13.x: only the driver's version is
    stated; the failing device calls are the real bindings'."""
    real = runtime_module.version_call
    monkeypatch.setattr(
        runtime_module, "version_call", lambda rt, name: 12040 if name == "cudaDriverGetVersion" else real(rt, name)
    )


def test_bindings_newer_than_the_driver_name_the_fix(cuda12_driver):
    reason = CudaBindingsRuntime().unavailable_reason()
    major = int(cuda_bindings.__version__.split(".")[0])
    assert f"needs an NVIDIA driver for CUDA {major} (r580 or newer)" in reason
    assert "this driver supports CUDA 12.4" in reason
    assert 'pip install "cuda-bindings>=12.6,<13"' in reason


def test_the_diagnostic_reports_the_mismatch_and_exits(cuda12_driver, capsys):
    from simpletuner.cli.diagnose import main

    with use_runtime(CudaBindingsRuntime()):
        code = main([])
    report = capsys.readouterr().out
    assert code == 3  # a verdict failed: the GPU is there, managed memory is not
    assert "needs an NVIDIA driver for CUDA 13" in report
    assert "Traceback" not in report


def test_hardware_detection_still_names_the_gpu(cuda12_driver):
    from simpletuner.hardware.machine import detect_hardware

    with use_runtime(CudaBindingsRuntime()) as rt:
        hw = detect_hardware(rt)
    assert hw.device_name == "NVIDIA H100 80GB HBM3" and hw.gpu_spec == "H100 SXM"
    assert hw.memory_kind.startswith("unknown")


def _config(make_config, tmp_path, **gh200):
    import orjson

    from simpletuner.configuration import load_config

    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(make_config(gh200_optimizations=gh200)))
    return load_config(str(path))


def test_training_runs_without_the_layer_and_says_so_once(cuda12_driver, make_config, tmp_path, caplog):
    from simpletuner.gh200.wiring import configure_runtime
    from simpletuner.state import StateTracker

    loaded = _config(make_config, tmp_path)
    state = StateTracker(loaded.config, loaded.raw)
    with use_runtime(CudaBindingsRuntime()), caplog.at_level(logging.WARNING, "simpletuner.gh200"):
        decided = configure_runtime(state.config, 1, True, tmp_path / "out", accumulation={})
    said = [r.getMessage() for r in caplog.records if "unified-memory layer is off" in r.getMessage()]
    assert len(said) == 1 and "needs an NVIDIA driver for CUDA 13" in said[0]
    assert decided.unified_memory["managed_memory_available"] is False


def test_a_config_that_asks_for_managed_memory_stops_with_the_reason(cuda12_driver, make_config, tmp_path):
    from simpletuner.gh200.managed_memory import check_managed_memory

    config = _config(make_config, tmp_path, managed_memory="frozen_weights").config
    with pytest.raises(ValueError, match="needs an NVIDIA driver for CUDA 13") as raised:
        check_managed_memory(config, CudaBindingsRuntime())
    assert 'Use managed_memory "caches" on this machine' in str(raised.value)


@pytest.mark.parametrize(
    ("driver", "expected"),
    [
        (0, "finds no NVIDIA driver (err); install or load the NVIDIA driver"),
        (12080, 'needs an NVIDIA driver for CUDA 13 (r580 or newer), but this driver supports CUDA 12.8 (err). '
                'Install the cuda-bindings of the driver\'s CUDA: pip install "cuda-bindings>=12.6,<13"'),
        (13000, "cuda-bindings 13.5.0 failed: err"),  # the driver is new enough: the error as CUDA said it
    ],
)  # fmt: skip
def test_bindings_error_reason(driver, expected):
    assert expected in bindings_error_reason("err", "13.5.0", 13050, driver)


def test_the_bindings_requirement_follows_the_cuda_major():
    assert bindings_requirement("12.8") == "cuda-bindings>=12.6,<13"
    assert bindings_requirement("13.0") == "cuda-bindings>=13,<14"
    assert install_hint("12.4") == 'pip install "cuda-bindings>=12.6,<13" (the CUDA major of this PyTorch build, 12.4)'
    assert install_hint("").startswith("install a CUDA build of PyTorch")
