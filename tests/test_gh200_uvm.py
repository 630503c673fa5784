"""Unified-memory hints (gh200.uvm) and the runtime behind them, against a recording fake.

The fake (tests/fake_cuda.py) remembers which CPU tensors are "managed" and records every
allocation, advice, prefetch and pin with its size and location, so each placement decision
is checked here on a CPU-only machine. One `gpu` test repeats the essentials on real CUDA.
"""

from __future__ import annotations

import logging
import sys
import types
from collections import namedtuple

import pytest
import torch
from fake_cuda import FakeRuntime, discrete_info, gb10_info, gh200_info

from simpletuner.gh200 import runtime as runtime_module
from simpletuner.gh200 import uvm
from simpletuner.gh200.runtime import (
    CudaBindingsRuntime,
    NoCudaRuntime,
    get_runtime,
    set_runtime,
    use_runtime,
)
from simpletuner.gh200.uvm import (
    ENV_VAR,
    gh200_uvm_enabled,
    optimize_batch_for_gh200,
    prefer_cpu_residency,
    prefer_gpu_residency,
    prefetch_to_device,
    set_uvm_hint_override,
    to_unified,
    unified_memory_status,
)

UVM_LOGGER = "simpletuner.gh200.uvm"
NO_CUDA_REASON = "no CUDA device in this test"


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch):
    """No env var from the caller's shell, no override, nothing said; the runtime restored."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(runtime_module, "_runtime", runtime_module._runtime)
    uvm._reset_for_tests()
    yield
    uvm._reset_for_tests()


def _managed(runtime: FakeRuntime, values: torch.Tensor) -> torch.Tensor:
    t = runtime.managed_empty(tuple(values.shape), values.dtype)
    t.copy_(values)
    return t


def _advice(runtime: FakeRuntime) -> list[tuple]:
    return [(c.detail, c.location, c.nbytes) for c in runtime.ops("advise")]


def _prefetches(runtime: FakeRuntime) -> list[tuple]:
    return [(c.location, c.detail, c.nbytes) for c in runtime.ops("prefetch")]


def _messages(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == UVM_LOGGER and r.levelno == level]


# --- whether hints are on ---


def test_hints_are_off_by_default(fake_runtime):
    assert gh200_uvm_enabled() is False


@pytest.mark.parametrize(
    "value, expected",
    [("1", True), ("true", True), ("TRUE", True), (" 1 ", True), ("0", False), ("false", False), ("False", False)],
)
def test_env_var_turns_hints_on_and_off(fake_runtime, monkeypatch, value, expected):
    monkeypatch.setenv(ENV_VAR, value)
    assert gh200_uvm_enabled() is expected


@pytest.mark.parametrize("override, env", [(True, "0"), (False, "1"), (True, None), (False, None)])
def test_override_beats_env(fake_runtime, monkeypatch, override, env):
    if env is not None:
        monkeypatch.setenv(ENV_VAR, env)
    set_uvm_hint_override(override)
    assert gh200_uvm_enabled() is override


def test_clearing_the_override_hands_the_choice_back_to_env(fake_runtime, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    set_uvm_hint_override(False)
    assert gh200_uvm_enabled() is False
    set_uvm_hint_override(None)
    assert gh200_uvm_enabled() is True


def test_invalid_env_value_warns_once_and_counts_as_unset(fake_runtime, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger=UVM_LOGGER)
    monkeypatch.setenv(ENV_VAR, "maybe")
    assert [gh200_uvm_enabled() for _ in range(3)] == [False, False, False]
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert ENV_VAR in warnings[0] and "maybe" in warnings[0]
    # Unset means the default: off, and the DEBUG line says so (not "=maybe"); off by default is no news at INFO.
    assert any("off by default" in m for m in _messages(caplog, logging.DEBUG))
    assert not any("off by default" in m for m in _messages(caplog, logging.INFO))


def test_invalid_env_value_does_not_override_the_config(fake_runtime, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "maybe")
    set_uvm_hint_override(True)
    assert gh200_uvm_enabled() is True


@pytest.mark.parametrize("value", [1, 0, "yes", "true", 1.0])
def test_override_rejects_non_bool(value):
    with pytest.raises(TypeError, match="True, False or None"):
        set_uvm_hint_override(value)
    set_uvm_hint_override(None)  # None stays legal


def test_no_cuda_keeps_hints_off_even_when_asked_and_says_why_once(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=UVM_LOGGER)
    monkeypatch.setenv(ENV_VAR, "1")
    set_uvm_hint_override(True)
    with use_runtime(NoCudaRuntime(NO_CUDA_REASON)):
        assert [gh200_uvm_enabled() for _ in range(4)] == [False] * 4
    why = [r for r in caplog.records if NO_CUDA_REASON in r.getMessage()]
    assert len(why) == 1
    assert why[0].levelno == logging.INFO and why[0].name == UVM_LOGGER


# --- residency advice and prefetch ---


def test_prefer_cpu_residency_advises_cpu_and_gpu_access(fake_runtime):
    set_uvm_hint_override(True)
    t = _managed(fake_runtime, torch.ones(3, 5))
    nbytes = t.untyped_storage().nbytes()
    assert nbytes == 60
    assert prefer_cpu_residency(t) is t
    assert _advice(fake_runtime) == [("preferred_location", "cpu", nbytes), ("accessed_by", 0, nbytes)]
    assert fake_runtime.ops("prefetch") == []


def test_prefer_gpu_residency_advises_the_current_device(fake_runtime):
    set_uvm_hint_override(True)
    t = _managed(fake_runtime, torch.ones(4, dtype=torch.float16))
    assert prefer_gpu_residency(t) is t
    assert _advice(fake_runtime) == [("preferred_location", 0, 8)]


@pytest.mark.parametrize(
    "device, stream, location, handle",
    [
        (None, None, 0, None),
        (torch.device("cuda:1"), None, 1, None),
        ("cuda:2", None, 2, None),
        ("cuda", None, 0, None),
        (3, None, 3, None),
        ("cpu", None, "cpu", None),
        (torch.device("cpu"), None, "cpu", None),
        (None, types.SimpleNamespace(cuda_stream=1234), 0, 1234),
        ("cuda:1", 77, 1, 77),
    ],
)
def test_prefetch_to_device_location_and_stream(fake_runtime, device, stream, location, handle):
    set_uvm_hint_override(True)
    t = _managed(fake_runtime, torch.zeros(2, 3))
    assert prefetch_to_device(t, device, stream) is t
    assert _prefetches(fake_runtime) == [(location, handle, 24)]
    assert fake_runtime.ops("advise") == []


HINT_FUNCTIONS = [prefer_cpu_residency, prefer_gpu_residency, prefetch_to_device]


@pytest.mark.parametrize("fn", HINT_FUNCTIONS)
def test_plain_tensor_is_left_alone(fake_runtime, fn):
    set_uvm_hint_override(True)
    plain = torch.ones(8)
    assert fn(plain) is plain
    assert fake_runtime.calls == []


@pytest.mark.parametrize("fn", HINT_FUNCTIONS)
@pytest.mark.parametrize("override", [False, None])
def test_hints_off_means_no_calls_on_managed_tensors(fake_runtime, fn, override):
    set_uvm_hint_override(override)
    t = _managed(fake_runtime, torch.ones(8))
    fake_runtime.calls.clear()
    assert fn(t) is t
    assert fake_runtime.calls == []


@pytest.mark.parametrize("fn", HINT_FUNCTIONS)
def test_no_cuda_returns_the_same_tensor(fn):
    set_uvm_hint_override(True)
    t = torch.arange(6.0)
    with use_runtime(NoCudaRuntime(NO_CUDA_REASON)):
        assert fn(t) is t  # NoCudaRuntime.advise/prefetch would raise if reached


@pytest.mark.parametrize("fn", HINT_FUNCTIONS)
def test_empty_tensor_is_left_alone(fake_runtime, fn):
    set_uvm_hint_override(True)
    keep = _managed(fake_runtime, torch.ones(2))  # noqa: F841 - a live managed allocation
    empty = fake_runtime.managed_empty((0, 4), torch.float32)
    fake_runtime.calls.clear()
    assert fn(empty) is empty
    assert fake_runtime.calls == []


@pytest.mark.parametrize("value", ["not a tensor", None, 3, [torch.ones(1)]])
def test_non_tensors_pass_through(fake_runtime, value):
    set_uvm_hint_override(True)
    assert prefer_cpu_residency(value) is value
    assert prefetch_to_device(value) is value
    assert fake_runtime.calls == []


# --- whole batches ---


def _nested_batch(runtime):
    m1 = _managed(runtime, torch.randn(2, 4, 8, 8))  # 2048 bytes
    m2 = _managed(runtime, torch.randn(2, 7, 16))  # 896
    m3 = _managed(runtime, torch.ones(2, 7, dtype=torch.int64))  # 112
    m4 = _managed(runtime, torch.randn(3))  # 12
    plain = torch.ones(5, dtype=torch.float16)  # 10, never managed
    batch = {
        "latents": m1,
        "conditioning": {"encoder_hidden_states": m2, "attention_mask": m3},
        "other": plain,
        "meta": "x",
        "list": [m4],
    }
    runtime.calls.clear()
    return batch, (m1, m2, m3, m4, plain)


def test_optimize_batch_places_and_prefetches_by_role(fake_runtime):
    set_uvm_hint_override(True)
    batch, (m1, m2, m3, m4, plain) = _nested_batch(fake_runtime)
    out = optimize_batch_for_gh200(batch)

    advice_by_size: dict[int, list] = {}
    for advice, location, nbytes in _advice(fake_runtime):
        advice_by_size.setdefault(nbytes, []).append((advice, location))
    assert advice_by_size == {
        2048: [("preferred_location", "cpu"), ("accessed_by", 0)],  # latents live in CPU RAM
        896: [("preferred_location", 0)],  # embeddings and masks on the GPU
        112: [("preferred_location", 0)],
    }
    prefetched = sorted(nbytes for location, stream, nbytes in _prefetches(fake_runtime) if location == 0)
    assert prefetched == [12, 112, 896, 2048]  # every managed tensor once, the plain one never
    assert len(fake_runtime.ops("prefetch")) == 4
    assert all(c.nbytes != plain.untyped_storage().nbytes() for c in fake_runtime.calls)

    assert list(out) == list(batch)
    assert out["latents"] is m1 and out["other"] is plain and out["meta"] == "x"
    assert type(out["conditioning"]) is dict
    assert out["conditioning"]["encoder_hidden_states"] is m2 and out["conditioning"]["attention_mask"] is m3
    assert type(out["list"]) is list and len(out["list"]) == 1 and out["list"][0] is m4


Pair = namedtuple("Pair", ["first", "second"])


def test_optimize_batch_keeps_tuples_and_namedtuples(fake_runtime):
    set_uvm_hint_override(True)
    a = _managed(fake_runtime, torch.ones(4))  # 16 bytes
    b = _managed(fake_runtime, torch.ones(8))  # 32
    c = _managed(fake_runtime, torch.ones(16))  # 64
    plain = torch.zeros(3)
    fake_runtime.calls.clear()
    batch = {"latents": (a, Pair(first=b, second=plain)), "prompt_embeds": Pair(c, "text")}
    out = optimize_batch_for_gh200(batch)

    assert type(out["latents"]) is tuple and len(out["latents"]) == 2
    assert out["latents"][0] is a
    inner = out["latents"][1]
    assert type(inner) is Pair and inner.first is b and inner.second is plain
    assert type(out["prompt_embeds"]) is Pair and out["prompt_embeds"] == Pair(c, "text")
    # The role comes from the nearest key and reaches into tuples.
    preferred = {
        (nbytes, location) for advice, location, nbytes in _advice(fake_runtime) if advice == "preferred_location"
    }
    assert preferred == {(16, "cpu"), (32, "cpu"), (64, 0)}
    assert sorted(c.nbytes for c in fake_runtime.ops("prefetch")) == [16, 32, 64]


def test_optimize_batch_top_level_namedtuple(fake_runtime):
    set_uvm_hint_override(True)
    a = _managed(fake_runtime, torch.ones(4))
    fake_runtime.calls.clear()
    out = optimize_batch_for_gh200(Pair(a, 7))
    assert type(out) is Pair and out.first is a and out.second == 7
    assert [c.op for c in fake_runtime.calls] == ["prefetch"]


@pytest.mark.parametrize("override", [False, None])
def test_optimize_batch_with_hints_off_makes_no_calls(fake_runtime, override):
    set_uvm_hint_override(override)
    batch, (m1, m2, m3, m4, plain) = _nested_batch(fake_runtime)
    out = optimize_batch_for_gh200(batch)
    assert fake_runtime.calls == []
    assert list(out) == list(batch)
    assert out["latents"] is m1 and out["other"] is plain and out["meta"] == "x"
    assert out["conditioning"]["encoder_hidden_states"] is m2 and out["conditioning"]["attention_mask"] is m3
    assert out["list"][0] is m4


def test_optimize_batch_without_cuda_is_identity():
    set_uvm_hint_override(True)
    t = torch.ones(3)
    batch = {"latents": t, "conditioning": {"attention_mask": (t,)}}
    with use_runtime(NoCudaRuntime(NO_CUDA_REASON)):
        out = optimize_batch_for_gh200(batch)
    assert out["latents"] is t and out["conditioning"]["attention_mask"][0] is t


# --- to_unified ---


@pytest.mark.parametrize("info", [gh200_info, gb10_info], ids=["gh200", "gb10"])
def test_to_unified_prefer_cpu(info):
    set_uvm_hint_override(True)
    runtime = FakeRuntime(info=info())
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with use_runtime(runtime):
        u = to_unified(t, "cpu")
    assert [(c.nbytes, c.detail) for c in runtime.ops("managed_alloc")] == [(48, (3, 4))]
    assert runtime.is_managed(u) and u is not t
    assert u.dtype == t.dtype and torch.equal(u, t)
    assert _advice(runtime) == [("preferred_location", "cpu", 48), ("accessed_by", 0, 48)]
    assert _prefetches(runtime) == [("cpu", None, 48)]
    assert runtime.ops("pin") == []


@pytest.mark.parametrize("info", [gh200_info, gb10_info], ids=["gh200", "gb10"])
def test_to_unified_prefer_gpu(info):
    set_uvm_hint_override(True)
    runtime = FakeRuntime(info=info())
    t = torch.randn(2, 7, 16, dtype=torch.bfloat16)
    with use_runtime(runtime):
        u = to_unified(t, "gpu")
    nbytes = 2 * 7 * 16 * 2
    assert [c.nbytes for c in runtime.ops("managed_alloc")] == [nbytes]
    assert runtime.is_managed(u) and torch.equal(u, t) and u.dtype == torch.bfloat16
    assert _advice(runtime) == [("preferred_location", 0, nbytes)]
    assert runtime.ops("prefetch") == []


def test_to_unified_copies_non_contiguous_input(fake_runtime):
    t = torch.arange(12.0).reshape(3, 4).t()
    u = to_unified(t)
    assert u.shape == (4, 3) and torch.equal(u, t) and fake_runtime.is_managed(u)


def test_to_unified_with_hints_off_is_managed_but_not_advised(fake_runtime):
    t = torch.ones(4)
    u = to_unified(t, "cpu")
    assert fake_runtime.is_managed(u) and torch.equal(u, t)
    assert [c.op for c in fake_runtime.calls] == ["managed_alloc"]


def test_to_unified_falls_back_to_pinned_memory_and_says_so_once(caplog):
    caplog.set_level(logging.INFO, logger=UVM_LOGGER)
    set_uvm_hint_override(True)
    runtime = FakeRuntime(reason="no managed memory", cuda=True)
    t = torch.arange(6, dtype=torch.float32)
    with use_runtime(runtime):
        results = [to_unified(t, prefer) for prefer in ("cpu", "gpu", "cpu")]
    assert all(torch.equal(r, t) for r in results)
    assert [c.nbytes for c in runtime.ops("pin")] == [24, 24, 24]
    assert runtime.ops("managed_alloc") == runtime.ops("advise") == runtime.ops("prefetch") == []
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert "pinned" in warnings[0] and "no managed memory" in warnings[0]


def test_to_unified_without_cuda_keeps_plain_memory_and_says_so_once(caplog):
    caplog.set_level(logging.INFO, logger=UVM_LOGGER)
    set_uvm_hint_override(True)
    t = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    with use_runtime(NoCudaRuntime(NO_CUDA_REASON)):
        results = [to_unified(t, prefer) for prefer in ("cpu", "gpu", "cpu")]
    for r in results:
        assert r.device.type == "cpu" and r.dtype == t.dtype and torch.equal(r, t) and r.is_contiguous()
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert "unified memory unavailable" in warnings[0] and NO_CUDA_REASON in warnings[0]


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
