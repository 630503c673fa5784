"""The CUDA runtime behind the unified-memory hints (hardware.runtime) and the status it reports,
against the recording fake (tests/fake_cuda.py) and a fake cuda-bindings module; the hints themselves
are in tests/test_gh200_uvm.py. One `gpu` test repeats a managed round trip on real CUDA.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from fake_cuda import FakeRuntime, discrete_info, gb10_info, gh200_info

from simpletuner.gh200.uvm import (
    gh200_uvm_enabled,
    optimize_batch_for_gh200,
    prefer_gpu_residency,
    prefetch_to_device,
    set_uvm_hint_override,
    to_unified,
    unified_memory_status,
)
from simpletuner.hardware.runtime import (
    CudaBindingsRuntime,
    NoCudaRuntime,
    get_runtime,
    set_runtime,
    use_runtime,
)

UVM_LOGGER = "simpletuner.gh200.uvm"
NO_CUDA_REASON = "no CUDA device in this test"

pytestmark = pytest.mark.usefixtures("clean_uvm_state")


def _managed(runtime: FakeRuntime, values: torch.Tensor) -> torch.Tensor:
    t = runtime.managed_empty(tuple(values.shape), values.dtype)
    t.copy_(values)
    return t


def _messages(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == UVM_LOGGER and r.levelno == level]


# --- status and device info ---

STATUS_KEYS = {"managed_memory_available", "reason", "hints_enabled", "device"}


@pytest.mark.parametrize(
    "info, kind_word, unified",
    [(gh200_info, "coherent", True), (gb10_info, "integrated", True), (discrete_info, "discrete", False)],
    ids=["gh200", "gb10", "discrete"],
)
def test_unified_memory_status_with_a_device(info, kind_word, unified):
    with use_runtime(FakeRuntime(info=info())):
        status = unified_memory_status()
    assert set(status) == STATUS_KEYS
    assert status["managed_memory_available"] is True and status["reason"] is None
    assert status["hints_enabled"] is False
    device = status["device"]
    assert device["name"] == info().name and device["total_bytes"] == info().total_bytes
    assert device["unified"] is unified and kind_word in device["kind"]


def test_unified_memory_status_reports_hints_when_on(fake_runtime):
    set_uvm_hint_override(True)
    assert unified_memory_status()["hints_enabled"] is True


def test_unified_memory_status_without_cuda():
    set_uvm_hint_override(True)
    with use_runtime(NoCudaRuntime(NO_CUDA_REASON)):
        status = unified_memory_status()
    assert status == {
        "managed_memory_available": False,
        "reason": NO_CUDA_REASON,
        "hints_enabled": False,
        "device": None,
    }


@pytest.mark.parametrize(
    "info, unified, integrated, kind_word",
    [
        (gh200_info, True, False, "coherent"),
        (gb10_info, True, True, "integrated"),
        (discrete_info, False, False, "discrete"),
    ],
    ids=["gh200", "gb10", "discrete"],
)
def test_device_memory_info_unified_and_kind(info, unified, integrated, kind_word):
    device = info()
    assert device.unified is unified and device.integrated is integrated
    assert device.kind.startswith(kind_word)
    as_dict = device.as_dict()
    assert as_dict["unified"] is unified and as_dict["kind"] == device.kind
    assert as_dict["compute_capability"] == device.compute_capability


def test_pageable_access_without_host_page_tables_is_not_unified():
    # x86 + HMM: the GPU can fault on pageable memory but through its own page tables (migration),
    # not coherently through the CPU's as on GH200.
    hmm = discrete_info().__class__(**{**discrete_info().__dict__, "pageable_memory_access": True})
    assert hmm.unified is False and hmm.kind.startswith("discrete")


def test_gh200_kind_comes_from_attributes_not_the_name():
    renamed = gh200_info().__class__(**{**gh200_info().__dict__, "name": "Some Other GPU"})
    assert renamed.unified and renamed.kind.startswith("coherent")


# --- NoCudaRuntime and runtime selection ---


def test_no_cuda_runtime_refuses_managed_operations_with_the_reason():
    rt = NoCudaRuntime(NO_CUDA_REASON)
    t = torch.ones(2)
    refused = (
        lambda: rt.managed_empty((2,), torch.float32),
        lambda: rt.advise(t, "preferred_location", "cpu"),
        lambda: rt.prefetch(t, 0),
    )
    for call in refused:
        with pytest.raises(RuntimeError, match=f"managed memory is unavailable: {NO_CUDA_REASON}"):
            call()
    with pytest.raises(RuntimeError, match="pinned memory needs a CUDA device"):
        rt.pin(t)
    assert rt.unavailable_reason() == NO_CUDA_REASON and rt.cuda_available() is False
    assert rt.is_managed(t) is False and rt.device_info() is None and rt.mem_get_info() == (0, 0)
    rt.synchronize()  # a no-op, not an error


def test_use_runtime_restores_the_previous_one():
    outer, inner = FakeRuntime(), NoCudaRuntime()
    set_runtime(outer)
    with use_runtime(inner) as got:
        assert got is inner and get_runtime() is inner
    assert get_runtime() is outer


def test_use_runtime_restores_even_on_exception():
    outer = FakeRuntime()
    set_runtime(outer)
    with pytest.raises(ValueError, match="boom"):
        with use_runtime(NoCudaRuntime()):
            with use_runtime(FakeRuntime()):
                raise ValueError("boom")
    assert get_runtime() is outer


def test_set_runtime_none_goes_back_to_the_real_runtime():
    fake = FakeRuntime()
    set_runtime(fake)
    assert get_runtime() is fake
    set_runtime(None)
    real = get_runtime()
    assert isinstance(real, CudaBindingsRuntime) and get_runtime() is real


# --- the real runtime on this machine ---


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
def test_real_runtime_on_cpu_says_why_it_is_unavailable():
    rt = CudaBindingsRuntime()
    reason = rt.unavailable_reason()
    assert isinstance(reason, str) and reason
    if torch.version.cuda is None:
        assert "has no CUDA" in reason and torch.__version__ in reason
    else:
        assert "no CUDA device" in reason
    assert rt.cuda_available() is False
    assert rt.is_managed(torch.ones(3)) is False
    assert rt.device_info() is None and rt.mem_get_info() == (0, 0) and rt.current_device() == 0
    assert rt.versions()["torch"] == torch.__version__
    with pytest.raises(RuntimeError, match="managed memory is unavailable"):
        rt.managed_empty((2,), torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
def test_uvm_on_the_real_cpu_runtime_falls_back(caplog):
    caplog.set_level(logging.INFO, logger=UVM_LOGGER)
    set_runtime(None)
    set_uvm_hint_override(True)
    t = torch.ones(4)
    assert gh200_uvm_enabled() is False
    assert optimize_batch_for_gh200({"latents": t})["latents"] is t
    assert torch.equal(to_unified(t), t)
    assert unified_memory_status()["managed_memory_available"] is False
    assert any("unified memory unavailable" in m for m in _messages(caplog, logging.WARNING))


# --- CudaBindingsRuntime against a fake cuda.bindings.runtime (both API generations) ---


class _FakeBindings(types.ModuleType):
    """The parts of ``cuda.bindings.runtime`` advice and prefetch use, with the real signatures.

    cuda-bindings 12.x: ``cudaMemAdvise(ptr, count, advice, int device)`` and
    ``cudaMemPrefetchAsync(ptr, count, int dstDevice, stream)``, the struct forms as ``*_v2``;
    ``cudaMemLocation`` exists there too (since CUDA 11.2, for memory pools).
    cuda-bindings 13.x: ``cudaMemAdvise(ptr, count, advice, cudaMemLocation)`` and
    ``cudaMemPrefetchAsync(ptr, count, cudaMemLocation, flags, stream)``.
    Calls are recorded as ``(op, ptr, count, advice, where, stream)`` with where "cpu" or a device.
    """

    def __init__(self, major: int):
        super().__init__("cuda.bindings.runtime")
        self.calls: list[tuple] = []
        self.cudaError_t = types.SimpleNamespace(cudaSuccess=0)
        self.cudaMemoryAdvise = types.SimpleNamespace(
            cudaMemAdviseSetReadMostly=1, cudaMemAdviseSetPreferredLocation=3, cudaMemAdviseSetAccessedBy=5
        )
        self.cudaMemLocationType = types.SimpleNamespace(cudaMemLocationTypeHost=3, cudaMemLocationTypeDevice=1)

        class cudaMemLocation:  # noqa: N801 - the bindings' name
            type = 0
            id = 0

        self.cudaMemLocation = cudaMemLocation
        if major == 12:
            self.cudaMemAdvise, self.cudaMemAdvise_v2 = self._advise_int, self._advise_struct
            self.cudaMemPrefetchAsync, self.cudaMemPrefetchAsync_v2 = self._prefetch_int, self._prefetch_struct
        else:
            self.cudaMemAdvise, self.cudaMemPrefetchAsync = self._advise_struct, self._prefetch_struct

    def _where_int(self, device):
        if not isinstance(device, int):
            raise TypeError(f"an integer is required for device, got {type(device).__name__}")
        return "cpu" if device == -1 else device

    def _where_struct(self, location):
        if not isinstance(location, self.cudaMemLocation):
            raise TypeError(f"location must be a cudaMemLocation, got {type(location).__name__}")
        return "cpu" if location.type == self.cudaMemLocationType.cudaMemLocationTypeHost else location.id

    def _advise_int(self, ptr, count, advice, device):
        self.calls.append(("advise", ptr, count, advice, self._where_int(device), None))
        return (0,)

    def _advise_struct(self, ptr, count, advice, location):
        self.calls.append(("advise", ptr, count, advice, self._where_struct(location), None))
        return (0,)

    def _prefetch_int(self, ptr, count, device, stream):
        self.calls.append(("prefetch", ptr, count, None, self._where_int(device), stream))
        return (0,)

    def _prefetch_struct(self, ptr, count, location, flags, stream):
        self.calls.append(("prefetch", ptr, count, None, self._where_struct(location), stream))
        return (0,)


def _install_bindings(monkeypatch, major: int) -> _FakeBindings:
    fake = _FakeBindings(major)
    cuda_pkg, bindings_pkg = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    cuda_pkg.bindings, bindings_pkg.runtime = bindings_pkg, fake
    monkeypatch.setitem(sys.modules, "cuda", cuda_pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings_pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", fake)
    return fake


def _advise_and_prefetch(rt: CudaBindingsRuntime, t: torch.Tensor) -> None:
    rt.advise(t, "preferred_location", "cpu")
    rt.advise(t, "accessed_by", 0)
    rt.advise(t, "read_mostly", 1)
    rt.prefetch(t, 0, stream=42)
    rt.prefetch(t, "cpu", stream=42)


def _expected_calls(t: torch.Tensor) -> list[tuple]:
    ptr, n = t.data_ptr(), t.untyped_storage().nbytes()
    return [
        ("advise", ptr, n, 3, "cpu", None),
        ("advise", ptr, n, 5, 0, None),
        ("advise", ptr, n, 1, 1, None),
        ("prefetch", ptr, n, None, 0, 42),
        ("prefetch", ptr, n, None, "cpu", 42),
    ]


def test_real_runtime_advice_and_prefetch_with_cuda_bindings_13(monkeypatch):
    fake = _install_bindings(monkeypatch, 13)
    t = torch.zeros(16)
    _advise_and_prefetch(CudaBindingsRuntime(), t)
    assert fake.calls == _expected_calls(t)


def test_real_runtime_advice_and_prefetch_with_cuda_bindings_12(monkeypatch):
    fake = _install_bindings(monkeypatch, 12)
    t = torch.zeros(16)
    _advise_and_prefetch(CudaBindingsRuntime(), t)
    assert fake.calls == _expected_calls(t)


def test_real_runtime_advice_stays_inside_the_allocation_for_views(monkeypatch):
    fake = _install_bindings(monkeypatch, 13)
    base = torch.zeros(16)
    view = base[4:]
    rt = CudaBindingsRuntime()
    rt.advise(view, "preferred_location", "cpu")
    rt.prefetch(view, 0, stream=1)
    start, end = base.untyped_storage().data_ptr(), base.untyped_storage().data_ptr() + base.untyped_storage().nbytes()
    for _, ptr, count, *_ in fake.calls:
        assert start <= ptr and ptr + count <= end


# --- real CUDA (runs only on a GPU machine) ---


@pytest.mark.gpu
def test_real_managed_memory_round_trip():
    rt = CudaBindingsRuntime()
    reason = rt.unavailable_reason()
    if reason is not None:
        pytest.skip(f"managed memory unavailable: {reason}")
    set_uvm_hint_override(True)
    t = torch.arange(4096, dtype=torch.float32)  # 16 KiB: far below any card's free memory
    with use_runtime(rt):
        assert gh200_uvm_enabled() is True
        u = to_unified(t, "cpu")
        assert rt.is_managed(u) is True
        assert u.is_cuda and torch.equal(u.cpu(), t)
        assert prefer_gpu_residency(u) is u
        assert prefetch_to_device(u) is u
        assert prefetch_to_device(u, "cpu", torch.cuda.current_stream()) is u
        out = optimize_batch_for_gh200({"latents": u, "prompt_embeds": to_unified(t, "gpu")})
        rt.synchronize()
    assert out["latents"] is u and torch.equal(out["prompt_embeds"].cpu(), t)
    assert rt.is_managed(torch.ones(2, device="cuda")) is False
