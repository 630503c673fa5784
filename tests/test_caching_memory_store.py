"""MemoryTensorStore (`memory` / `unified_memory` caches) and open_caches' cache types."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from fake_cuda import FakeRuntime
from fakes import RecordingEncoder, bucket_of, latent_items

from simpletuner.caching import (
    MemoryTensorStore,
    ShardedTensorStore,
    TensorCache,
    open_caches,
)
from simpletuner.gh200 import uvm
from simpletuner.gh200.uvm import ENV_VAR, set_uvm_hint_override
from simpletuner.hardware.runtime import NoCudaRuntime, use_runtime
from simpletuner.state import StateTracker

NO_CUDA_REASON = "no CUDA device in this test"


@pytest.fixture(autouse=True)
def _clean_uvm_state(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    uvm._reset_for_tests()
    yield
    uvm._reset_for_tests()


@pytest.fixture
def hints_on(fake_runtime):
    """The fake GH200 runtime with hints on, as the trainer sets them for a unified cache."""
    set_uvm_hint_override(True)
    return fake_runtime


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("shard-*.safetensors")) if folder.exists() else []


# --- MemoryTensorStore ---


def test_memory_store_mapping_surface():
    store = MemoryTensorStore("vae")
    a, b, c = torch.randn(4, 8, 8), torch.randn(4, 8, 4), torch.arange(3)
    assert store.put_many({"a": {"latent": a}, "b": {"latent": b, "extra": c}}) is None
    assert len(store) == 2 and store.keys() == ["a", "b"] and list(store) == ["a", "b"]
    assert "a" in store and "b" in store and "z" not in store
    assert torch.equal(store.get("a")["latent"], a)
    got_b, got_a = store.get_many(["b", "a"])
    assert set(got_b) == {"latent", "extra"}
    assert torch.equal(got_b["latent"], b) and torch.equal(got_b["extra"], c) and torch.equal(got_a["latent"], a)
    assert store.root == "<memory:vae>"
    store.put_many({"a": {"latent": b}})  # overwrite
    assert len(store) == 2 and torch.equal(store.get("a")["latent"], b)


def test_memory_store_missing_key_names_the_cache():
    store = MemoryTensorStore("text")
    store.put_many({"a": {"embeds": torch.ones(2)}})
    with pytest.raises(KeyError, match=r"'missing' is not in the text cache"):
        store.get("missing")
    with pytest.raises(KeyError, match="text cache"):
        store.get_many(["a", "missing"])


def test_memory_store_keeps_detached_cpu_tensors():
    store = MemoryTensorStore("vae")
    weight = torch.ones(3, requires_grad=True)
    store.put_many({"a": {"latent": weight * 2}})
    stored = store.get("a")["latent"]
    assert stored.device.type == "cpu" and not stored.requires_grad and stored.grad_fn is None
    assert torch.equal(stored, torch.full((3,), 2.0))


def test_memory_store_entry_does_not_follow_the_callers_tensor():
    store = MemoryTensorStore("vae")
    batch = torch.zeros(2, 4)
    store.put_many({"a": {"latent": batch[0]}, "b": {"latent": batch[1]}})
    batch.fill_(7.0)  # e.g. the next encode writes into the same buffer
    assert torch.equal(store.get("a")["latent"], torch.zeros(4))
    assert torch.equal(store.get("b")["latent"], torch.zeros(4))


def test_unified_store_entry_does_not_follow_the_callers_tensor(tmp_path, hints_on):
    _, text = open_caches(tmp_path, "sd", vae_type="memory", text_type="unified_memory", persistent=False)
    source = torch.zeros(2, 5)
    text.store.put_many({"a": {"embeds": source}})
    source.fill_(1.0)
    assert torch.equal(text.store.get("a")["embeds"], torch.zeros(2, 5))


# --- persistence ---


def test_persistent_memory_store_writes_through_and_reloads(tmp_path):
    folder = tmp_path / "vae"
    store = MemoryTensorStore("vae", backing=ShardedTensorStore(folder))
    assert store.root == folder
    values = {f"k{i}": {"latent": torch.randn(4, 8, 8).half(), "size": torch.tensor([64, 64])} for i in range(5)}
    shard = store.put_many(values)
    assert shard is not None and shard.exists() and _shards(folder) == [shard]

    again = MemoryTensorStore("vae", backing=ShardedTensorStore(folder))
    assert sorted(again.keys()) == sorted(values) and len(again) == 5
    for key, entry in values.items():
        got = again.get(key)
        assert set(got) == {"latent", "size"}
        assert got["latent"].dtype == torch.float16 and torch.equal(got["latent"], entry["latent"])
        assert torch.equal(got["size"], entry["size"])


def test_memory_store_without_backing_writes_nothing(tmp_path):
    vae, text = open_caches(tmp_path, "sd", vae_type="memory", text_type="memory", persistent=False)
    vae.fill(latent_items(4), RecordingEncoder(), batch_size=2, group=bucket_of)
    text.store.put_many({"p": {"embeds": torch.ones(7, 16)}})
    assert len(vae) == 4 and len(text) == 1
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize("kind", ["memory", "unified_memory"])
def test_next_run_loads_from_disk_instead_of_encoding(tmp_path, hints_on, kind):
    items = latent_items(6)
    first = RecordingEncoder()
    vae, _ = open_caches(tmp_path, "sd", vae_type=kind, text_type=kind, persistent=True)
    report = vae.fill(items, first, batch_size=4, group=bucket_of)
    assert report.num_computed == 6 and first.num_computed == 6
    assert _shards(tmp_path / "sd" / "vae")

    second = RecordingEncoder()
    vae2, _ = open_caches(tmp_path, "sd", vae_type=kind, text_type=kind, persistent=True)
    assert len(vae2) == 6
    report = vae2.fill(items, second, batch_size=4, group=bucket_of)
    assert second.calls == [] and report.num_hits == 6 and report.num_computed == 0
    keys = [key for key, payload in items if payload["bucket"] == (64, 64)]
    assert vae2.get_batch(keys)["latent"][:, 0, 0, 0].tolist() == [float(i) for i in (1, 2, 4, 5)]


# --- open_caches: store classes and registration ---


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("vae_type", ["disk", "memory", "unified_memory"])
@pytest.mark.parametrize("text_type", ["disk", "memory", "unified_memory"])
def test_open_caches_store_classes_and_registered_folders(tmp_path, fake_runtime, vae_type, text_type, persistent):
    state = StateTracker(config=None)
    vae, text = open_caches(
        tmp_path, "sd", state.register_cache_dir, vae_type=vae_type, text_type=text_type, persistent=persistent
    )
    folders = {"vae": tmp_path / "sd" / "vae", "text": tmp_path / "sd" / "text"}
    expected_on_disk = set()
    for name, cache, kind in (("vae", vae, vae_type), ("text", text, text_type)):
        assert isinstance(cache, TensorCache) and cache.name == name
        if kind == "disk":
            assert type(cache.store) is ShardedTensorStore and cache.store.root == folders[name]
        else:
            assert type(cache.store) is MemoryTensorStore
            if persistent:
                assert isinstance(cache.store.backing, ShardedTensorStore)
                assert cache.store.backing.root == folders[name]
            else:
                assert cache.store.backing is None
        if kind == "disk" or persistent:
            expected_on_disk.add(folders[name])
        cache.store.put_many({"k": {name: torch.ones(2, 3)}})

    assert set(state.cache_dirs) == expected_on_disk
    written = {folder for folder in folders.values() if _shards(folder)}
    assert written == expected_on_disk


@pytest.mark.parametrize(
    "vae_type, text_type, bad", [("ram", "disk", "ram"), ("disk", "ssd", "ssd"), ("Memory", "memory", "Memory")]
)
def test_open_caches_rejects_unknown_types(tmp_path, vae_type, text_type, bad):
    state = StateTracker(config=None)
    with pytest.raises(ValueError) as error:
        open_caches(tmp_path, "sd", state.register_cache_dir, vae_type=vae_type, text_type=text_type)
    message = str(error.value)
    assert repr(bad) in message and "disk, memory, unified_memory" in message
    assert state.cache_dirs == []


# --- unified_memory placement ---


def test_unified_caches_place_latents_on_cpu_and_embeddings_on_gpu(tmp_path, hints_on):
    runtime = hints_on
    vae, text = open_caches(tmp_path, "sd", vae_type="unified_memory", text_type="unified_memory", persistent=False)
    latent, embeds = torch.randn(4, 8, 8), torch.randn(7, 16, dtype=torch.float16)  # 1024 and 224 bytes
    vae.store.put_many({"img": {"latent": latent}})
    text.store.put_many({"prompt": {"embeds": embeds}})

    assert [c.nbytes for c in runtime.ops("managed_alloc")] == [1024, 224]
    assert [(c.detail, c.location, c.nbytes) for c in runtime.ops("advise")] == [
        ("preferred_location", "cpu", 1024),
        ("accessed_by", 0, 1024),
        ("preferred_location", 0, 224),
    ]
    assert [(c.location, c.nbytes) for c in runtime.ops("prefetch")] == [("cpu", 1024)]
    stored_latent, stored_embeds = vae.store.get("img")["latent"], text.store.get("prompt")["embeds"]
    assert runtime.is_managed(stored_latent) and runtime.is_managed(stored_embeds)
    assert torch.equal(stored_latent, latent) and torch.equal(stored_embeds, embeds)
    assert runtime.ops("pin") == []


def test_unified_store_prefetches_each_entry_on_read(tmp_path, hints_on):
    runtime = hints_on
    _, text = open_caches(tmp_path, "sd", vae_type="disk", text_type="unified_memory", persistent=False)
    text.store.put_many({f"p{i}": {"embeds": torch.full((7, 16), float(i)), "mask": torch.ones(7)} for i in range(3)})
    runtime.calls.clear()

    got = text.store.get_many(["p2", "p0"])
    assert [c.location for c in runtime.ops("prefetch")] == [0, 0, 0, 0]  # two entries, two tensors each
    assert sorted(c.nbytes for c in runtime.ops("prefetch")) == [28, 28, 448, 448]
    assert runtime.ops("advise") == [] and runtime.ops("managed_alloc") == []
    assert got[0]["embeds"][0, 0].item() == 2.0 and got[1]["embeds"][0, 0].item() == 0.0

    runtime.calls.clear()
    batch = text.get_batch(["p0", "p1", "p2"])
    assert len(runtime.ops("prefetch")) == 6
    assert batch["embeds"].shape == (3, 7, 16) and batch["embeds"][:, 0, 0].tolist() == [0.0, 1.0, 2.0]


def test_plain_memory_store_makes_no_runtime_calls(tmp_path, hints_on):
    runtime = hints_on
    vae, text = open_caches(tmp_path, "sd", vae_type="memory", text_type="memory", persistent=False)
    vae.store.put_many({"img": {"latent": torch.randn(4, 8, 8)}})
    text.store.put_many({"prompt": {"embeds": torch.randn(7, 16)}})
    vae.store.get_many(["img"])
    text.get_batch(["prompt"])
    assert runtime.calls == []


def test_unified_store_loaded_from_disk_is_placed_in_managed_memory(tmp_path, hints_on):
    latent = torch.randn(4, 8, 8)
    vae, _ = open_caches(tmp_path, "sd", vae_type="unified_memory", text_type="disk", persistent=True)
    vae.store.put_many({"img": {"latent": latent}})

    reloaded = FakeRuntime()
    with use_runtime(reloaded):
        vae2, _ = open_caches(tmp_path, "sd", vae_type="unified_memory", text_type="disk", persistent=True)
        stored = vae2.store.get("img")["latent"]
    assert reloaded.is_managed(stored) and torch.equal(stored, latent)
    assert [(c.detail, c.location) for c in reloaded.ops("advise")] == [
        ("preferred_location", "cpu"),
        ("accessed_by", 0),
    ]


@pytest.mark.parametrize("persistent", [False, True])
def test_unified_memory_without_cuda_falls_back_with_a_warning(tmp_path, caplog, persistent):
    caplog.set_level(logging.INFO, logger="simpletuner.gh200.uvm")
    set_uvm_hint_override(True)
    latent, embeds = torch.randn(4, 8, 8), torch.randn(7, 16)
    with use_runtime(NoCudaRuntime(NO_CUDA_REASON)):
        vae, text = open_caches(
            tmp_path, "sd", vae_type="unified_memory", text_type="unified_memory", persistent=persistent
        )
        vae.store.put_many({"img": {"latent": latent}})
        text.store.put_many({"prompt": {"embeds": embeds}})
        got_latent = vae.get_batch(["img"])["latent"][0]
        got_embeds = text.store.get("prompt")["embeds"]
    assert torch.equal(got_latent, latent) and torch.equal(got_embeds, embeds)
    assert got_latent.device.type == "cpu"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "unified memory unavailable" in warnings[0] and NO_CUDA_REASON in warnings[0]
    assert bool(_shards(tmp_path / "sd" / "vae")) is persistent


# --- TensorCache over a memory store ---


@pytest.mark.parametrize("kind", ["memory", "unified_memory"])
def test_tensor_cache_fill_and_get_batch_on_a_memory_store(tmp_path, hints_on, kind):
    vae, _ = open_caches(tmp_path, "sd", vae_type=kind, text_type="disk", persistent=False)
    items = latent_items(9)
    encoder = RecordingEncoder()
    report = vae.fill(items, encoder, batch_size=2, group=bucket_of)
    assert (report.num_items, report.num_hits, report.num_computed) == (9, 0, 9)
    assert all(len(call) <= 2 for call in encoder.calls)
    assert len(vae) == 9

    keys = [items[i][0] for i in (8, 1, 5, 4)]  # all (64, 64)
    batch = vae.get_batch(keys)
    assert batch["latent"].shape == (4, 4, 8, 8) and batch["latent"].dtype == torch.float16
    assert batch["latent"][:, 0, 0, 0].tolist() == [8.0, 1.0, 5.0, 4.0]
    assert vae.get_batch([items[3][0]])["latent"].shape == (1, 4, 4, 8)  # the (64, 32) bucket
    with pytest.raises(ValueError, match="batch keys must share a bucket"):
        vae.get_batch([items[0][0], items[1][0]])

    again = RecordingEncoder()
    report = vae.fill(items, again, batch_size=2, group=bucket_of)
    assert again.calls == [] and report.num_hits == 9
