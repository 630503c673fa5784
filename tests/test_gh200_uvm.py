"""Unified-memory hints (gh200.uvm) against a recording fake (the runtime itself: test_gh200_runtime.py).

The fake (tests/fake_cuda.py) remembers which CPU tensors are "managed" and records every
allocation, advice, prefetch and pin with its size and location, so each placement decision
is checked here on a CPU-only machine.
"""

from __future__ import annotations

import logging
import types
from collections import namedtuple

import pytest
import torch
from fake_cuda import FakeRuntime, gb10_info, gh200_info

from simpletuner.gh200.uvm import (
    ENV_VAR,
    gh200_uvm_enabled,
    optimize_batch_for_gh200,
    prefer_cpu_residency,
    prefer_gpu_residency,
    prefetch_to_device,
    set_uvm_hint_override,
    to_unified,
)
from simpletuner.hardware.runtime import (
    NoCudaRuntime,
    use_runtime,
)

UVM_LOGGER = "simpletuner.gh200.uvm"
NO_CUDA_REASON = "no CUDA device in this test"

pytestmark = pytest.mark.usefixtures("clean_uvm_state")


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
