"""Runtime wiring: a JSON config -> hint override, caches in (fake) unified memory, the ramp,
and the decisions recorded in the StateTracker and the run folder."""

from __future__ import annotations

import json
import logging

import orjson
import pytest

from simpletuner.configuration import load_config
from simpletuner.gh200 import uvm
from simpletuner.gh200.wiring import RUNTIME_FILE, configure_runtime
from simpletuner.hardware.runtime import NoCudaRuntime, use_runtime
from simpletuner.state import StateTracker
from simpletuner.training.accumulation import build_accumulation
from simpletuner.training.trainer import Trainer

UNIFIED = {"vae_cache_type": "unified_memory", "text_cache_type": "unified_memory", "persistent_cache": False}
RAMP = {
    "enable_batch_size_rampup": True,
    "initial_effective_batch_size": 2,
    "target_effective_batch_size": 4,
    "batch_rampup_steps": 2,
}


def _write(tmp_path, raw) -> str:
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    return str(path)


def _trainer(path) -> Trainer:
    loaded = load_config(path)
    return Trainer(StateTracker(loaded.config, loaded.raw))


def test_json_config_drives_unified_caches_hints_and_ramp(fake_runtime, make_config, tmp_path):
    raw = make_config(
        max_train_steps=3, cache_config={**UNIFIED, "cache_dir": str(tmp_path / "cache")}, gh200_optimizations=RAMP
    )
    trainer = _trainer(_write(tmp_path, raw))
    result = trainer.train()

    assert trainer.state.raw_config["gh200_optimizations"] == RAMP  # the loader kept the raw JSON
    decided = trainer.state.gh200_runtime_config
    on_disk = json.loads((trainer.output_dir / RUNTIME_FILE).read_text())
    assert on_disk == json.loads(orjson.dumps(decided, default=str))
    assert decided["uvm_hint_override"] is True and decided["uvm_hints_active"] is True
    assert decided["unified_memory"]["device"]["unified"] is True
    assert decided["accumulation"]["kind"] == "gh200_ramp"
    assert (decided["vae_cache_type"], decided["text_cache_type"]) == ("unified_memory", "unified_memory")

    # Every cached tensor went into managed memory, advised to its side.
    reports = trainer.data.fill_reports
    stored = reports["latents"].num_computed + reports["text"].num_computed
    entries = {
        t.untyped_storage().data_ptr()
        for cache in (trainer.data.vae_cache, trainer.data.text_cache)
        for entry in cache.store._entries.values()
        for t in entry.values()
    }
    assert len(entries) == stored
    entry_advice = [c for c in fake_runtime.ops("advise") if c.ptr in entries and c.detail == "preferred_location"]
    assert sum(c.location == "cpu" for c in entry_advice) == reports["latents"].num_computed > 0
    assert sum(c.location == 0 for c in entry_advice) == reports["text"].num_computed > 0
    # Each prepared batch (the FLOP-counting one, then every micro-batch) was stacked into managed memory
    # and went through the batch hook once: latents and prompt embeddings, placed and prefetched.
    micro = trainer.progress.micro_batches_seen
    stacked = [c for c in fake_runtime.ops("managed_alloc") if c.ptr not in entries]
    assert len(stacked) == 2 * (micro + 1)
    for alloc in stacked:
        hook = [
            (c.op, c.detail, c.location) for c in fake_runtime.calls if c.ptr == alloc.ptr and c.op != "managed_alloc"
        ]
        role = (
            [("advise", "preferred_location", "cpu"), ("advise", "accessed_by", 0)]
            if len(alloc.detail) == 4
            else [("advise", "preferred_location", 0)]
        )
        assert hook == role + [("prefetch", None, "cpu")]  # to the training device (the CPU in this test)
    # Before stacking, each entry a micro-batch reads was prefetched to the GPU, once per batch.
    to_gpu = [c for c in fake_runtime.ops("prefetch") if c.location == 0]
    assert all(c.ptr in entries for c in to_gpu)
    assert len(to_gpu) >= micro * (raw["train_batch_size"] + 1)  # its latents, and at least one caption
    assert fake_runtime.synchronized == 0
    assert result.global_step == 3
    pool = fake_runtime.pool_stats()
    assert trainer.last_logs["managed_pool_gib"] == pytest.approx(pool["reserved_bytes"] / 2**30)
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # not persistent: nothing on disk


def test_unified_memory_without_cuda_warns_falls_back_and_trains(make_config, tmp_path, caplog):
    uvm._reset_for_tests()
    raw = make_config(max_train_steps=2, cache_config={**UNIFIED, "cache_dir": str(tmp_path / "cache")})
    caplog.set_level(logging.INFO)
    with use_runtime(NoCudaRuntime()):
        trainer = _trainer(_write(tmp_path, raw))
        result = trainer.train()
    uvm._reset_for_tests()
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "unified memory unavailable" in r.getMessage()
    ]
    assert warnings == [
        "unified memory unavailable (no CUDA device (torch.cuda.is_available() is False)); "
        "keeping the cache in plain CPU memory"
    ]
    assert result.global_step == 2
    status = trainer.state.gh200_runtime_config["unified_memory"]
    assert status["managed_memory_available"] is False and "no CUDA" in status["reason"]


def test_persistent_unified_cache_is_loaded_next_run(fake_runtime, make_config, tmp_path):
    cache = {**UNIFIED, "persistent_cache": True, "cache_dir": str(tmp_path / "cache")}
    first = _trainer(
        _write(tmp_path, make_config(max_train_steps=1, cache_config=cache, output_dir=str(tmp_path / "a")))
    )
    first.train()
    assert first.data.fill_reports["latents"].num_computed > 0
    second = _trainer(
        _write(tmp_path, make_config(max_train_steps=1, cache_config=cache, output_dir=str(tmp_path / "b")))
    )
    second.train()
    reports = second.data.fill_reports
    assert reports["latents"].num_computed == 0 and reports["text"].num_computed == 0
    assert reports["latents"].num_hits == first.data.fill_reports["latents"].num_items


@pytest.mark.parametrize(
    "config_hint, env, expected",
    [
        (None, None, False),  # default off
        (None, "1", True),  # environment turns them on
        (False, "1", False),  # config beats environment
        (True, "0", True),
    ],
)
def test_hint_precedence(fake_runtime, make_config, tmp_path, monkeypatch, config_hint, env, expected):
    if env is None:
        monkeypatch.delenv(uvm.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(uvm.ENV_VAR, env)
    opts = {} if config_hint is None else {"enable_uvm_hints": config_hint}
    loaded = load_config(_write(tmp_path, make_config(gh200_optimizations=opts)))
    state = StateTracker(loaded.config, loaded.raw)
    policy = build_accumulation(state.config, num_processes=1)
    decided = configure_runtime(
        state.config,
        num_processes=1,
        is_main_process=False,
        output_dir=tmp_path / "out",
        accumulation=policy.state_dict(),
    )
    assert decided.uvm_hints_active is expected
    assert uvm.gh200_uvm_enabled() is expected
    assert policy.state_dict() == {"kind": "fixed", "steps": 1}
    assert not (tmp_path / "out").exists()  # only the main process writes the file
