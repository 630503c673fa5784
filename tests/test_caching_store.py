"""ShardedTensorStore: round trips, atomic shards, header-only index, corrupt shards."""

import logging

import pytest
import torch

from simpletuner.caching import ShardedTensorStore


def _entry(seed: int, dtype=torch.float16, shape=(4, 8, 8)) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "latent": torch.randn(shape, generator=generator).to(dtype),
        "size": torch.tensor([seed, seed + 1], dtype=torch.int64),
    }


def _assert_entry_equal(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype
        assert torch.equal(actual[name], expected[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.bool])
def test_round_trip_dtypes(tmp_path, dtype):
    store = ShardedTensorStore(tmp_path)
    entries = {
        "a": {"x": (torch.rand(3, 5) * 10).to(dtype), "scalar": torch.tensor(2.5, dtype=torch.float32)},
        "b": {"x": (torch.rand(1) * 10).to(dtype), "scalar": torch.tensor(-1.0)},
    }
    store.put_many(entries)
    for key, expected in entries.items():
        _assert_entry_equal(store.get(key), expected)


def test_views_of_one_batch_and_non_contiguous_tensors_are_stored(tmp_path):
    store = ShardedTensorStore(tmp_path)
    batch = torch.randn(3, 4, 6)
    entries = {f"k{i}": {"latent": batch[i], "t": batch[i].T} for i in range(3)}
    store.put_many(entries)
    for i in range(3):
        got = store.get(f"k{i}")
        assert torch.equal(got["latent"], batch[i]) and torch.equal(got["t"], batch[i].T)


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    store = ShardedTensorStore(tmp_path)
    shard = store.put_many({"a": _entry(0), "b": _entry(1)})
    assert shard.parent == tmp_path and shard.name.startswith("shard-")
    assert [p.name for p in tmp_path.iterdir()] == [shard.name]


def test_failed_write_cleans_up(tmp_path, monkeypatch):
    store = ShardedTensorStore(tmp_path)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("simpletuner.caching.store.os.replace", boom)
    with pytest.raises(OSError, match="disk full"):
        store.put_many({"a": _entry(0)})
    assert list(tmp_path.iterdir()) == []
    assert "a" not in store


def test_reopened_store_indexes_from_headers(tmp_path):
    store = ShardedTensorStore(tmp_path)
    store.put_many({"a": _entry(0), "b": _entry(1)})
    store.put_many({"c": _entry(2, dtype=torch.bfloat16, shape=(16, 2, 2))})
    reopened = ShardedTensorStore(tmp_path)
    assert len(reopened) == 3 and set(reopened.keys()) == {"a", "b", "c"}
    assert "a" in reopened and "zzz" not in reopened
    _assert_entry_equal(reopened.get("c"), _entry(2, dtype=torch.bfloat16, shape=(16, 2, 2)))
    assert len(reopened.shard_paths()) == 2


def test_refresh_sees_shards_from_another_writer(tmp_path):
    reader = ShardedTensorStore(tmp_path)
    ShardedTensorStore(tmp_path).put_many({"a": _entry(0)})
    assert "a" not in reader
    assert reader.refresh() == 1
    _assert_entry_equal(reader.get("a"), _entry(0))


def test_truncated_shard_is_skipped_with_warning(tmp_path, caplog):
    store = ShardedTensorStore(tmp_path)
    good = store.put_many({"a": _entry(0)})
    bad = store.put_many({"b": _entry(1), "c": _entry(2)})
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    (tmp_path / "notes.txt").write_text("ignored")
    with caplog.at_level(logging.WARNING, logger="simpletuner.caching.store"):
        reopened = ShardedTensorStore(tmp_path)
    assert str(bad) in caplog.text
    assert "a" in reopened and "b" not in reopened and "c" not in reopened
    assert reopened.shard_paths() == [good]
    with pytest.raises(KeyError):
        reopened.get("b")


def test_get_many_across_shards_keeps_order(tmp_path):
    store = ShardedTensorStore(tmp_path)
    store.put_many({"a": _entry(0), "b": _entry(1)})
    store.put_many({"c": _entry(2)})
    store.put_many({"d": _entry(3)})
    order = ["d", "a", "c", "b", "a"]
    got = store.get_many(order)
    for key, entry in zip(order, got):
        _assert_entry_equal(entry, _entry("abcd".index(key)))


def test_newer_shard_wins_for_a_rewritten_key(tmp_path):
    store = ShardedTensorStore(tmp_path)
    store.put_many({"a": _entry(0)})
    store.put_many({"a": _entry(5)})
    _assert_entry_equal(store.get("a"), _entry(5))
    assert len(store) == 1


def test_missing_key_error_names_key_and_root(tmp_path):
    store = ShardedTensorStore(tmp_path)
    store.put_many({"a": _entry(0)})
    with pytest.raises(KeyError, match="nope") as info:
        store.get_many(["a", "nope"])
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize(
    "entries, match",
    [
        ({}, "at least one"),
        ({"a|b": {"x": torch.zeros(1)}}, "must not contain"),
        ({"a": {}}, "non-empty"),
        ({"a": {"x": [1, 2]}}, "not a torch.Tensor"),
    ],
)
def test_put_many_rejects_bad_entries(tmp_path, entries, match):
    with pytest.raises(ValueError, match=match):
        ShardedTensorStore(tmp_path).put_many(entries)


def test_load_all_into_memory(tmp_path):
    store = ShardedTensorStore(tmp_path, max_open_shards=1)
    for i in range(3):
        store.put_many({f"k{i}": _entry(i)})
    everything = store.load_all_into_memory()
    assert sorted(everything) == ["k0", "k1", "k2"]
    for i in range(3):
        _assert_entry_equal(everything[f"k{i}"], _entry(i))


def test_root_that_is_a_file_is_rejected(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        ShardedTensorStore(path)
