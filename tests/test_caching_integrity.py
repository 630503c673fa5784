"""Cache integrity: checksums in shard headers, verify, re-encoding on fill, old and damaged shards."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from simpletuner.caching import (
    CacheIntegrityError,
    MemoryTensorStore,
    ShardedTensorStore,
    TensorCache,
)
from simpletuner.caching.integrity import CHECKSUM_PREFIX, read_header, tensor_checksum


def _entry(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(4, 8, 8, generator=generator).half(), "size": torch.tensor([seed, 7])}


def _compute(payloads):
    """The 'encoder' of these tests: payload i -> _entry(i)."""
    return [_entry(p) for p in payloads]


def _items(n: int) -> list[tuple[str, int]]:
    return [(f"k{i}", i) for i in range(n)]


def _assert_entry(actual, seed: int):
    expected = _entry(seed)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype and torch.equal(actual[name], expected[name]), name


def flip_byte(shard: Path, key: str, name: str = "latents", offset: int = 5) -> None:
    """Flip one byte inside the data of tensor ``key|name`` of ``shard``, in place."""
    header = read_header(shard)
    begin, end = header.tensors[f"{key}|{name}"]["data_offsets"]
    assert offset < end - begin
    with open(shard, "r+b") as file:
        file.seek(header.data_start + begin + offset)
        byte = file.read(1)
        file.seek(header.data_start + begin + offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def truncate(shard: Path) -> None:
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])


def _filled(folder: Path, n: int = 6, flush_every: int = 3) -> TensorCache:
    cache = TensorCache(ShardedTensorStore(folder), "vae", flush_every=flush_every)
    report = cache.fill(_items(n), _compute, batch_size=flush_every)  # one shard per batch
    assert report.num_computed == n
    return cache


def _shard_of(store: ShardedTensorStore, key: str) -> Path:
    return next(shard for shard, keys in store.shard_entries().items() if key in keys)


# --- what is written ---


def test_shards_record_format_2_and_a_checksum_per_tensor(tmp_path):
    store = ShardedTensorStore(tmp_path)
    shard = store.put_many({"a": _entry(0), "b": _entry(1)})
    with safe_open(str(shard), framework="pt") as handle:
        metadata = handle.metadata()
        names = sorted(handle.keys())
    assert metadata["version"] == "2" and metadata["num_entries"] == "2"
    assert names == ["a|latents", "a|size", "b|latents", "b|size"]
    for name in names:
        key, _, tensor = name.partition("|")
        assert metadata[CHECKSUM_PREFIX + name] == tensor_checksum(_entry("ab".index(key))[tensor])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.bool, torch.int64])
def test_both_check_paths_accept_every_dtype_and_shape(tmp_path, dtype):
    store = ShardedTensorStore(tmp_path)
    store.put_many(
        {
            "a": {"x": (torch.rand(3, 5) * 10).to(dtype), "scalar": torch.tensor(2.5)},
            "b": {"x": (torch.rand(1) * 10).to(dtype), "empty": torch.zeros(0, 4, dtype=dtype)},
        }
    )
    report = ShardedTensorStore(tmp_path).verify()  # from the file's bytes
    assert report.is_clean and report.num_ok == 2
    read = ShardedTensorStore(tmp_path).read_checked(["a", "b"])  # from the tensors
    assert read.problems == {} and sorted(read.entries) == ["a", "b"]


def test_verify_clean_store_across_many_shards(tmp_path):
    cache = _filled(tmp_path, n=10, flush_every=1)
    report = ShardedTensorStore(tmp_path).verify()
    assert report.is_clean and report.num_ok == 10 and report.num_unverified == 0
    assert cache.store.verify(["k3", "not-stored"]).num_ok == 1  # unknown keys are plain misses


def test_threaded_verify_finds_the_same_as_serial(tmp_path, monkeypatch):
    cache = _filled(tmp_path, n=12, flush_every=2)
    flip_byte(_shard_of(cache.store, "k3"), "k3")
    flip_byte(_shard_of(cache.store, "k8"), "k8", name="size", offset=0)
    serial = ShardedTensorStore(tmp_path).verify()
    monkeypatch.setattr("simpletuner.caching.shard_checks._VERIFY_WORKERS", 4)
    threaded = ShardedTensorStore(tmp_path).verify()
    assert sorted(threaded.problems) == sorted(serial.problems) == ["k3", "k8"]
    assert threaded.num_ok == serial.num_ok == 10


# --- a flipped byte ---


def test_flipped_byte_is_reported_naming_key_tensor_and_shard(tmp_path):
    cache = _filled(tmp_path)
    shard = _shard_of(cache.store, "k4")
    flip_byte(shard, "k4")
    report = ShardedTensorStore(tmp_path).verify()
    assert list(report.problems) == ["k4"] and report.num_ok == 5
    reason = report.problems["k4"]
    assert "checksum mismatch" in reason and "'latents'" in reason and shard.name in reason
    # The same from the tensor-reading path (memory caches load through it).
    read = ShardedTensorStore(tmp_path).read_checked([f"k{i}" for i in range(6)])
    assert list(read.problems) == ["k4"] and len(read.entries) == 5


def test_fill_re_encodes_a_corrupt_entry_and_serves_correct_data(tmp_path, caplog):
    cache = _filled(tmp_path)
    flip_byte(_shard_of(cache.store, "k1"), "k1")
    reopened = TensorCache(ShardedTensorStore(tmp_path), "vae")
    calls = []
    with caplog.at_level(logging.WARNING, logger="simpletuner.caching.tensor_cache"):
        report = reopened.fill(_items(6), lambda p: calls.append(list(p)) or _compute(p), batch_size=2)
    assert calls == [[1]]
    assert report.corrupt == ("k1",) and report.num_computed == 1 and report.num_hits == 5
    assert "re-encoded 1 corrupt entries: k1 (checksum mismatch" in caplog.text
    _assert_entry(reopened.get("k1"), 1)
    # A later start serves the re-encoded copy (newest wins) and finds nothing to do.
    again = TensorCache(ShardedTensorStore(tmp_path), "vae")
    assert again.store.verify().is_clean
    report = again.fill(_items(6), _compute, batch_size=2)
    assert report.num_computed == 0 and report.corrupt == ()
    for i in range(6):
        _assert_entry(again.get(f"k{i}"), i)


def test_newest_copy_wins_even_when_file_times_are_shuffled(tmp_path):
    cache = _filled(tmp_path, n=2, flush_every=2)
    old = _shard_of(cache.store, "k0")
    flip_byte(old, "k0")
    TensorCache(ShardedTensorStore(tmp_path), "vae").fill(_items(2), _compute, batch_size=2)
    new = next(p for p in tmp_path.glob("shard-*.safetensors") if p != old)
    os.utime(new, ns=(1, 1))  # as after a copy that does not keep timestamps
    store = ShardedTensorStore(tmp_path)
    assert store.verify().is_clean
    _assert_entry(store.get("k0"), 0)
    assert store.superseded() == {old: ["k0"]}


def test_header_dtype_change_of_the_same_width_is_caught(tmp_path):
    store = ShardedTensorStore(tmp_path)
    shard = store.put_many({"a": {"latents": torch.randn(4, 4).half()}})
    data = shard.read_bytes()
    assert data.count(b'"F16"') == 1
    shard.write_bytes(data.replace(b'"F16"', b'"I16"'))
    reopened = ShardedTensorStore(tmp_path)
    assert "checksum mismatch" in reopened.verify().problems["a"]


def test_verification_can_be_turned_off(tmp_path):
    cache = _filled(tmp_path)
    flip_byte(_shard_of(cache.store, "k2"), "k2")
    trusting = TensorCache(ShardedTensorStore(tmp_path), "vae", verify=False)
    assert trusting.fill(_items(6), _compute, batch_size=2).num_computed == 0


# --- a truncated shard ---


def test_truncated_shard_entries_are_misses_reported_and_re_encoded(tmp_path, caplog):
    cache = _filled(tmp_path, n=6, flush_every=3)
    shard = _shard_of(cache.store, "k4")
    lost = set(cache.store.shard_entries()[shard])
    truncate(shard)
    with caplog.at_level(logging.WARNING, logger="simpletuner.caching.store"):
        store = ShardedTensorStore(tmp_path)
    assert f"skipping unreadable cache shard {shard}: truncated" in caplog.text
    assert "its 3 entries are misses and will be re-encoded" in caplog.text
    assert not lost & set(store.keys())
    report = store.verify()
    assert set(report.problems) == lost and all("truncated" in r for r in report.problems.values())
    assert list(report.unreadable_shards) == [shard]

    cache = TensorCache(store, "vae")
    report = cache.fill(_items(6), _compute, batch_size=2)
    assert set(report.corrupt) == lost and report.num_computed == 3
    # The damaged file is moved aside, so the next start neither warns nor re-encodes.
    assert not shard.exists() and shard.with_name(shard.name + ".corrupt").exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="simpletuner.caching.store"):
        again = ShardedTensorStore(tmp_path)
    assert caplog.text == "" and again.verify().is_clean
    for i in range(6):
        _assert_entry(again.get(f"k{i}"), i)


def test_garbage_header_is_unreadable_and_quarantined(tmp_path):
    store = ShardedTensorStore(tmp_path)
    store.put_many({"a": _entry(0)})
    (tmp_path / "shard-garbage.safetensors").write_bytes(b"\xff" * 64)
    reopened = ShardedTensorStore(tmp_path)
    assert "a" in reopened
    [(path, reason)] = reopened.unreadable_shards.items()
    assert path.name == "shard-garbage.safetensors" and "header" in reason
    assert [p.name for p in reopened.quarantine_unreadable()] == ["shard-garbage.safetensors.corrupt"]


def test_shard_removed_under_a_running_reader_raises_a_clear_error(tmp_path):
    _filled(tmp_path, n=2, flush_every=2)
    store = ShardedTensorStore(tmp_path)
    _shard_of(store, "k0").unlink()
    with pytest.raises(CacheIntegrityError, match="simpletuner cache verify"):
        store.get_many(["k0"])


# --- other format versions ---


def _write_v1_shard(folder: Path, entries: dict[str, dict[str, torch.Tensor]]) -> Path:
    """A shard as the format-1 writer made it: same tensors, no checksums."""
    flat = {f"{key}|{name}": t for key, entry in entries.items() for name, t in entry.items()}
    path = folder / "shard-v1.safetensors"
    metadata = {"format": "simpletuner.sharded_tensor_store", "version": "1", "num_entries": str(len(entries))}
    save_file(flat, str(path), metadata=metadata)
    return path


def test_format_1_shards_are_readable_and_reported_unverified(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    _write_v1_shard(folder, {f"k{i}": _entry(i) for i in range(3)})
    store = ShardedTensorStore(folder)
    _assert_entry(store.get("k1"), 1)
    report = store.verify()
    assert report.is_clean and report.num_unverified == 3 and report.num_ok == 0
    # A fill uses them as hits; new entries go to format-2 shards.
    cache = TensorCache(store, "vae")
    report = cache.fill(_items(4), _compute, batch_size=2)
    assert report.num_hits == 3 and report.num_computed == 1
    mixed = ShardedTensorStore(folder).verify()
    assert (mixed.num_ok, mixed.num_unverified) == (1, 3)
    # Loaded into memory, they count as unverified but are used.
    memory = MemoryTensorStore("vae", backing=ShardedTensorStore(folder))
    assert len(memory) == 4


def test_format_1_shard_missing_a_tensor_is_still_caught(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    path = _write_v1_shard(folder, {"a": _entry(0)})
    store = ShardedTensorStore(folder)
    path.unlink()
    save_file({"a|size": _entry(0)["size"]}, str(path), metadata={"version": "1"})
    assert "missing" in store.verify().problems["a"]


def test_newer_format_shard_is_skipped_not_moved(tmp_path, caplog):
    save_file({"a|x": torch.zeros(2)}, str(tmp_path / "shard-new.safetensors"), metadata={"version": "3"})
    with caplog.at_level(logging.WARNING, logger="simpletuner.caching.store"):
        store = ShardedTensorStore(tmp_path)
    assert "a" not in store and "newer simpletuner" in caplog.text
    assert store.quarantine_unreadable() == [] and (tmp_path / "shard-new.safetensors").exists()


# --- memory stores loading from a damaged backing store ---


def test_memory_store_does_not_load_corrupt_entries_and_fill_re_encodes_them(tmp_path, caplog):
    cache = _filled(tmp_path, n=6, flush_every=3)
    flip_byte(_shard_of(cache.store, "k0"), "k0")
    truncate(_shard_of(cache.store, "k5"))  # k3, k4, k5
    with caplog.at_level(logging.WARNING):
        memory = MemoryTensorStore("vae", backing=ShardedTensorStore(tmp_path))
    assert sorted(memory.keys()) == ["k1", "k2"]
    assert "4 corrupt entries" in caplog.text and "were not loaded" in caplog.text
    report = memory.verify([f"k{i}" for i in range(6)])
    assert sorted(report.problems) == ["k0", "k3", "k4", "k5"]
    assert "checksum mismatch" in report.problems["k0"] and "truncated" in report.problems["k3"]

    filled = TensorCache(memory, "vae").fill(_items(6), _compute, batch_size=2)
    assert sorted(filled.corrupt) == ["k0", "k3", "k4", "k5"] and filled.num_computed == 4
    for i in range(6):
        _assert_entry(memory.get(f"k{i}"), i)
    assert memory.verify().is_clean
    # Written through: the next run loads every entry, all sound.
    reloaded = MemoryTensorStore("vae", backing=ShardedTensorStore(tmp_path))
    assert len(reloaded) == 6 and reloaded.verify().is_clean
    for i in range(6):
        _assert_entry(reloaded.get(f"k{i}"), i)


def test_memory_store_without_backing_verifies_clean():
    memory = MemoryTensorStore("text")
    memory.put_many({"a": {"x": torch.ones(2)}})
    report = memory.verify()
    assert report.is_clean and report.num_ok == 1 and memory.quarantine_unreadable() == []


# --- compaction (clear --stale-only) ---


def test_compact_keeps_only_sound_needed_entries(tmp_path):
    cache = _filled(tmp_path, n=6, flush_every=3)  # shards {k0,k1,k2} and {k3,k4,k5}
    first, second = _shard_of(cache.store, "k0"), _shard_of(cache.store, "k3")
    flip_byte(first, "k1")
    (tmp_path / "shard-x.safetensors.corrupt").write_bytes(b"old damage")
    cache.store.put_many({"k2": _entry(2)})  # supersedes k2 in the first shard
    store = ShardedTensorStore(tmp_path)
    assert store.superseded() == {first: ["k2"]}

    report = store.compact(keep={"k0", "k1", "k2", "k3", "k4"})  # k5 is stale, k1 corrupt
    assert report.num_entries_removed == 3  # k1, stale k5, superseded k2
    assert report.num_shards_rewritten == 2 and report.bytes_after < report.bytes_before
    assert not first.exists() and not second.exists()
    assert not list(tmp_path.glob("*.corrupt"))

    after = ShardedTensorStore(tmp_path)
    assert sorted(after.keys()) == ["k0", "k2", "k3", "k4"]
    assert after.verify().is_clean and after.superseded() == {}
    for key in after.keys():
        _assert_entry(after.get(key), int(key[1:]))


def test_compact_deletes_shards_with_nothing_to_keep_and_leaves_sound_ones(tmp_path):
    cache = _filled(tmp_path, n=6, flush_every=3)
    first, second = _shard_of(cache.store, "k0"), _shard_of(cache.store, "k3")
    report = ShardedTensorStore(tmp_path).compact(keep={"k0", "k1", "k2"})
    assert (report.num_entries_removed, report.num_shards_rewritten, report.num_files_deleted) == (3, 0, 1)
    assert first.exists() and not second.exists()
