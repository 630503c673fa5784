"""Both tensor stores satisfy :class:`TensorStore`: by structure (members and parameter names) and by
behaviour, the shared surface exercised the same way on disk, in memory, and in memory backed by disk."""

from __future__ import annotations

import inspect

import pytest
import torch

from simpletuner.caching import MemoryTensorStore, ShardedTensorStore, TensorStore


def _members() -> list[str]:
    """The methods the protocol itself declares."""
    return [
        name
        for name, value in vars(TensorStore).items()
        if inspect.isfunction(value) and value.__qualname__ == f"TensorStore.{name}"
    ]


def _parameters(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values()]


@pytest.fixture(params=["disk", "memory", "memory+disk"])
def store(request, tmp_path):
    if request.param == "disk":
        return ShardedTensorStore(tmp_path / "store")
    if request.param == "memory":
        return MemoryTensorStore("vae")
    return MemoryTensorStore("vae", backing=ShardedTensorStore(tmp_path / "store"))


@pytest.mark.parametrize("cls", [ShardedTensorStore, MemoryTensorStore])
def test_every_protocol_method_exists_with_the_same_parameters(cls):
    members = _members()
    assert {"get_many", "put_many", "verify", "write_marker", "__contains__"} <= set(members)
    for name in members:
        assert _parameters(getattr(cls, name)) == _parameters(getattr(TensorStore, name)), name


def test_both_stores_are_tensor_stores(store):
    assert isinstance(store, TensorStore)
    assert not isinstance(object(), TensorStore)


def test_the_shared_surface_behaves_alike(store):
    a, b = {"x": torch.ones(2)}, {"x": torch.zeros(2), "y": torch.arange(3)}
    store.put_many({"a": a, "b": b}, source_hashes={"a": "hash-a"})
    assert "a" in store and "c" not in store and len(store) == 2
    assert sorted(store) == sorted(store.keys()) == ["a", "b"]
    assert torch.equal(store.get("a")["x"], a["x"])
    first, second, again = store.get_many(["b", "a", "b"])
    assert torch.equal(first["y"], b["y"]) and torch.equal(second["x"], a["x"]) and torch.equal(again["x"], b["x"])
    with pytest.raises(KeyError, match="'c'"):
        store.get("c")
    assert store.source_hashes(["a", "b"]) == {"a": "hash-a", "b": None}
    report = store.verify(["a", "b"])
    assert report.num_ok == 2 and report.problems == {}
    assert store.quarantine_unreadable() == []

    store.write_marker("epoch-1", {"num_entries": 2})
    assert store.read_marker("epoch-1") == {"num_entries": 2} and store.read_marker("epoch-2") is None
    assert store.marker_names() == ["epoch-1"]
    store.remove_marker("epoch-1")
    store.remove_marker("epoch-1")  # nothing there: no error
    assert store.marker_names() == []

    store.discard(["a"])
    assert "a" not in store and len(store) == 1
    assert store.remove(["b", "c"]) == 1
    assert len(store) == 0 and store.keys() == []
