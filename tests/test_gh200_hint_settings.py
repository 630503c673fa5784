"""Where unified-memory hints are switched: the fork's environment name as an alias, no silent
winner between the two names, and hints forced off turning `unified_memory` caches into
CPU-backed `memory` caches (seed 002), on CPU against the recording fake runtime."""

from __future__ import annotations

import logging

import orjson
import pytest
import torch

from simpletuner.caching import MemoryTensorStore, open_caches
from simpletuner.caching.opening import open_tensor_cache
from simpletuner.configuration import load_config
from simpletuner.gh200 import uvm
from simpletuner.gh200.uvm import (
    ENV_ALIAS,
    ENV_VAR,
    cache_type_in_use,
    env_hint_request,
    gh200_uvm_enabled,
    set_uvm_hint_override,
)
from simpletuner.gh200.wiring import configure_runtime
from simpletuner.state import StateTracker
from simpletuner.training.accumulation import build_accumulation

UNIFIED = {"vae_cache_type": "unified_memory", "text_cache_type": "unified_memory", "persistent_cache": False}
FALLBACK = "caches of type `unified_memory` are CPU-backed `memory` caches"


@pytest.fixture(autouse=True)
def _no_hint_env(monkeypatch):
    for name in (ENV_VAR, ENV_ALIAS):
        monkeypatch.delenv(name, raising=False)


def _fixed(state: StateTracker) -> dict:
    """The accumulation record the trainer passes for ``state``'s config (one process)."""
    return build_accumulation(state.config, 1).state_dict()


def _state(make_config, tmp_path, **overrides) -> StateTracker:
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(make_config(**overrides)))
    loaded = load_config(str(path))
    return StateTracker(loaded.config, loaded.raw)


def _fill(cache, n: int = 3) -> None:
    cache.fill(
        [(f"k{i}", i) for i in range(n)], lambda ids: [{"x": torch.full((2, 3), float(i))} for i in ids], batch_size=4
    )


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


# --- the environment: alias and conflicts ---


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("0", False), ("off", False)])
def test_the_forks_variable_name_is_an_alias(fake_runtime, monkeypatch, value, expected):
    monkeypatch.setenv(ENV_ALIAS, value)
    assert gh200_uvm_enabled() is expected
    assert env_hint_request() == (expected, f"{ENV_ALIAS}={value}")


@pytest.mark.parametrize("a, b, expected", [("1", "true", True), ("0", "no", False)])
def test_both_names_agreeing_is_fine(fake_runtime, monkeypatch, a, b, expected):
    monkeypatch.setenv(ENV_VAR, a)
    monkeypatch.setenv(ENV_ALIAS, b)
    assert gh200_uvm_enabled() is expected
    assert env_hint_request()[1] == f"{ENV_VAR}={a} and {ENV_ALIAS}={b}"


def test_both_names_disagreeing_stop_with_both_named(fake_runtime, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    monkeypatch.setenv(ENV_ALIAS, "0")
    with pytest.raises(ValueError) as error:
        gh200_uvm_enabled()
    message = str(error.value)
    assert f"{ENV_VAR}='1'" in message and f"{ENV_ALIAS}='0'" in message and "disagree" in message
    assert f"unset {ENV_ALIAS}" in message  # the fix


def test_an_invalid_alias_value_is_ignored_with_a_warning(fake_runtime, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="simpletuner.gh200.uvm")
    monkeypatch.setenv(ENV_ALIAS, "maybe")
    monkeypatch.setenv(ENV_VAR, "1")
    assert gh200_uvm_enabled() is True
    assert _warnings(caplog, f"{ENV_ALIAS}='maybe' is not 1/0")


def test_run_start_stops_on_disagreeing_names_even_when_the_config_decides(
    fake_runtime, make_config, tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV_VAR, "0")
    monkeypatch.setenv(ENV_ALIAS, "1")
    state = _state(make_config, tmp_path, gh200_optimizations={"enable_uvm_hints": True})
    with pytest.raises(ValueError, match=f"{ENV_VAR}='0' and {ENV_ALIAS}='1' disagree"):
        configure_runtime(state.config, 1, True, tmp_path / "out", accumulation=_fixed(state))
    assert not (tmp_path / "out").exists()  # stopped before anything was decided or written


def test_alias_drives_a_run(fake_runtime, make_config, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="simpletuner.gh200.wiring")
    monkeypatch.setenv(ENV_ALIAS, "1")
    state = _state(make_config, tmp_path)
    decided = configure_runtime(state.config, 1, False, tmp_path / "out", accumulation=_fixed(state)).as_record()
    assert decided["uvm_hints_active"] is True and decided["uvm_hints_setting"] == f"{ENV_ALIAS}=1"
    assert f"GH200 unified-memory hints are on: {ENV_ALIAS}=1" in caplog.text


def test_the_config_overriding_the_environment_is_said(fake_runtime, make_config, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")
    state = _state(make_config, tmp_path, gh200_optimizations={"enable_uvm_hints": True})
    decided = configure_runtime(state.config, 1, False, tmp_path / "out", accumulation=_fixed(state))
    assert decided.uvm_hints_setting == (
        f"gh200_optimizations.enable_uvm_hints=true (the config overrides {ENV_VAR}=0)"
    )


# --- hints forced off: unified_memory caches are CPU memory caches ---


@pytest.mark.parametrize("how", ["config", "env", "alias"])
def test_unified_caches_with_hints_forced_off_are_cpu_memory_caches(fake_runtime, tmp_path, monkeypatch, caplog, how):
    caplog.set_level(logging.INFO)
    if how == "config":
        set_uvm_hint_override(False, "gh200_optimizations.enable_uvm_hints=false")
        setting = "gh200_optimizations.enable_uvm_hints=false"
    else:
        name = ENV_VAR if how == "env" else ENV_ALIAS
        monkeypatch.setenv(name, "0")
        setting = f"{name}=0"
    vae, text = open_caches(tmp_path, "sd", None, "unified_memory", "unified_memory", persistent=False)
    epoch = open_tensor_cache(tmp_path / "epoch", "unified_memory", "vae-epoch", persistent=False)
    for cache in (vae, text, epoch):
        assert isinstance(cache.store, MemoryTensorStore) and cache.store.stack is torch.stack
        _fill(cache)
        batch = cache.get_batch(["k0", "k2"])["x"]
        assert batch.shape == (2, 2, 3) and float(batch[1, 0, 0]) == 2.0
    assert fake_runtime.calls == []  # no managed allocation, advice or prefetch
    [warning] = _warnings(caplog, FALLBACK)  # said once for all three caches
    assert setting in warning and "unified_memory" in warning and "turn that setting on or remove it" in warning


def test_hints_off_only_by_default_keep_managed_memory(fake_runtime, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    vae, _ = open_caches(tmp_path, "sd", None, "unified_memory", "disk", persistent=False)
    _fill(vae)
    assert [c.op for c in fake_runtime.calls] == ["managed_alloc"] * 3
    assert not _warnings(caplog, FALLBACK)
    assert cache_type_in_use("unified_memory") == "unified_memory"


def test_a_persistent_unified_cache_reloads_as_a_memory_cache_with_hints_off(fake_runtime, tmp_path):
    set_uvm_hint_override(True, "test")
    first, _ = open_caches(tmp_path, "sd", None, "unified_memory", "disk", persistent=True)
    _fill(first)
    set_uvm_hint_override(False, "gh200_optimizations.enable_uvm_hints=false")
    fake_runtime.calls.clear()
    again, _ = open_caches(tmp_path, "sd", None, "unified_memory", "disk", persistent=True)
    assert len(again) == 3 and fake_runtime.calls == []
    assert torch.equal(again.get("k1")["x"], torch.full((2, 3), 1.0))


@pytest.mark.parametrize(
    "config_hint, env, in_use",
    [
        (False, None, "memory"),  # the config forces them off
        (None, "0", "memory"),  # the environment forces them off: it beats the cache type
        (None, "1", "unified_memory"),
        (None, None, "unified_memory"),  # nothing says: the cache type turns hints on
        (True, "0", "unified_memory"),  # the config beats the environment
    ],
)
def test_run_start_records_the_cache_types_in_use(
    fake_runtime, make_config, tmp_path, monkeypatch, caplog, config_hint, env, in_use
):
    caplog.set_level(logging.INFO)
    if env is not None:
        monkeypatch.setenv(ENV_ALIAS, env)
    opts = {} if config_hint is None else {"enable_uvm_hints": config_hint}
    state = _state(make_config, tmp_path, cache_config=UNIFIED, gh200_optimizations=opts)
    decided = configure_runtime(state.config, 1, False, tmp_path / "out", accumulation=_fixed(state)).as_record()
    assert decided["vae_cache_type"] == decided["text_cache_type"] == "unified_memory"  # what was asked
    assert decided["vae_cache_type_in_use"] == decided["text_cache_type_in_use"] == in_use  # what is used
    assert decided["uvm_hints_active"] is (in_use == "unified_memory")
    assert len(_warnings(caplog, FALLBACK)) == (in_use == "memory")


def test_training_with_unified_caches_and_hints_forced_off_uses_cpu_memory(fake_runtime, make_config, tmp_path, caplog):
    from simpletuner.training.trainer import Trainer

    caplog.set_level(logging.INFO)
    state = _state(
        make_config,
        tmp_path,
        max_train_steps=2,
        cache_config={**UNIFIED, "cache_dir": str(tmp_path / "c")},
        gh200_optimizations={"enable_uvm_hints": False},
    )
    trainer = Trainer(state)
    result = trainer.train()
    assert result.global_step == 2
    assert isinstance(trainer.data.vae_cache.store, MemoryTensorStore)
    assert fake_runtime.calls == []  # CPU RAM only: no managed memory anywhere
    [warning] = _warnings(caplog, FALLBACK)
    assert "gh200_optimizations.enable_uvm_hints=false" in warning
    assert uvm.hints_forced_off() == "gh200_optimizations.enable_uvm_hints=false"
