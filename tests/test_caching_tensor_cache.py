"""TensorCache: encode only misses, batch by group, stack batches; open_caches."""

import pytest
import torch
from fakes import RecordingEncoder, bucket_of, latent_items

from simpletuner.caching import (
    FillReport,
    ShardedTensorStore,
    TensorCache,
    open_caches,
)
from simpletuner.state import StateTracker


def test_fill_computes_only_misses(tmp_path):
    cache = TensorCache(ShardedTensorStore(tmp_path), "vae")
    items = latent_items(10)
    encoder = RecordingEncoder()
    report = cache.fill(items[:4], encoder, batch_size=3, group=bucket_of)
    assert report.num_computed == 4 and report.num_hits == 0
    report = cache.fill(items, encoder, batch_size=3, group=bucket_of)
    assert isinstance(report, FillReport)
    assert (report.num_items, report.num_hits, report.num_computed) == (10, 4, 6)
    assert encoder.num_computed == 10
    assert report.seconds >= 0


def test_misses_are_encoded_within_the_batches_planned_over_every_item(tmp_path):
    """The batches are cut from all 10 items (bucket (64, 32): 0, 3, 6, 9; (64, 64): the others, 3 a
    batch); each call gets the misses of one of them, so a miss never meets another batch's entries."""
    cache = TensorCache(ShardedTensorStore(tmp_path), "vae")
    items = latent_items(10)
    cache.fill(items[:4], RecordingEncoder(), batch_size=3, group=bucket_of)
    encoder = RecordingEncoder()
    cache.fill(items, encoder, batch_size=3, group=bucket_of)
    # planned: [1, 2, 4], [0, 3, 6], [5, 7, 8], [9]; 0 to 3 are stored
    assert [[p["id"] for p in call] for call in encoder.calls] == [[4], [6], [5, 7, 8], [9]]


def test_second_fill_and_reopen_compute_nothing(tmp_path):
    items = latent_items(7)
    first = RecordingEncoder()
    TensorCache(ShardedTensorStore(tmp_path), "vae").fill(items, first, batch_size=4, group=bucket_of)
    again = RecordingEncoder()
    report = TensorCache(ShardedTensorStore(tmp_path), "vae").fill(items, again, batch_size=4, group=bucket_of)
    assert again.calls == [] and report.num_hits == 7 and report.num_computed == 0


@pytest.mark.parametrize("change", [{"resolution": 128}, {"encoder_identity": "vae-b"}, {"crop": {"top": 4}}])
def test_changing_one_key_component_makes_exactly_that_item_a_miss(tmp_path, change):
    cache = TensorCache(ShardedTensorStore(tmp_path), "vae")
    cache.fill(latent_items(6), RecordingEncoder(), batch_size=2, group=bucket_of)
    encoder = RecordingEncoder()
    report = cache.fill(latent_items(6, indices={4}, change=change), encoder, batch_size=2, group=bucket_of)
    assert report.num_computed == 1 and report.num_hits == 5
    assert [p["id"] for call in encoder.calls for p in call] == [4]


def test_batches_never_mix_groups_and_respect_batch_size(tmp_path):
    cache = TensorCache(ShardedTensorStore(tmp_path), "vae")
    encoder = RecordingEncoder()  # asserts one bucket per call itself
    cache.fill(latent_items(20), encoder, batch_size=4, group=bucket_of)
    assert all(1 <= len(call) <= 4 for call in encoder.calls)
    assert sorted(p["id"] for call in encoder.calls for p in call) == list(range(20))


def test_duplicate_keys_are_computed_once(tmp_path):
    cache = TensorCache(ShardedTensorStore(tmp_path), "vae")
    items = latent_items(3)
    encoder = RecordingEncoder()
    report = cache.fill(items + items[:2], encoder, batch_size=8, group=bucket_of)
    assert encoder.num_computed == 3 and report.num_items == 3


def test_fill_writes_shards_as_it_goes_and_keeps_work_on_a_crash(tmp_path):
    store = ShardedTensorStore(tmp_path)
    cache = TensorCache(store, "vae", flush_every=2)
    items = [(key, {**payload, "bucket": (64, 64)}) for key, payload in latent_items(7)]
    encoder = RecordingEncoder()

    def crashes_on_third_batch(payloads):
        if len(encoder.calls) == 2:
            raise RuntimeError("out of memory")
        return encoder(payloads)

    with pytest.raises(RuntimeError):
        cache.fill(items, crashes_on_third_batch, batch_size=2)
    assert len(store) == 4 and len(store.shard_paths()) == 2
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("shard-")] == []
    resumed = RecordingEncoder()
    report = cache.fill(items, resumed, batch_size=2)
    assert report.num_hits == 4 and resumed.num_computed == 3


def test_compute_must_return_one_entry_per_payload(tmp_path):
    cache = TensorCache(ShardedTensorStore(tmp_path), "vae")
    with pytest.raises(ValueError, match="returned 1 results for 2"):
        cache.fill(latent_items(2), lambda payloads: [{"x": torch.zeros(1)}], batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        cache.fill(latent_items(2), RecordingEncoder(), batch_size=0)


def test_get_batch_stacks_in_key_order(tmp_path):
    cache = TensorCache(ShardedTensorStore(tmp_path), "vae", flush_every=3)
    items = latent_items(9)
    cache.fill(items, RecordingEncoder(), batch_size=2, group=bucket_of)
    keys = [items[i][0] for i in (8, 1, 5, 4)]  # all in the (64, 64) bucket, several shards
    batch = cache.get_batch(keys)
    assert batch["latent"].shape == (4, 4, 8, 8) and batch["latent"].dtype == torch.float16
    assert batch["latent"][:, 0, 0, 0].tolist() == [8.0, 1.0, 5.0, 4.0]


def test_get_batch_rejects_mismatched_entries(tmp_path):
    cache = TensorCache(ShardedTensorStore(tmp_path), "vae")
    items = latent_items(2)  # item 0 is (64, 32), item 1 is (64, 64)
    cache.fill(items, RecordingEncoder(), batch_size=2, group=bucket_of)
    with pytest.raises(ValueError, match=items[1][0]):
        cache.get_batch([items[0][0], items[1][0]])
    cache.store.put_many({"other": {"text": torch.zeros(2)}})
    with pytest.raises(ValueError, match="different tensors"):
        cache.get_batch([items[0][0], "other"])
    with pytest.raises(ValueError, match="at least one"):
        cache.get_batch([])


def test_open_caches_registers_folders(tmp_path):
    state = StateTracker(config=None)
    vae_cache, text_cache = open_caches(tmp_path, "sd15-tiny", record_cache_dir=state.register_cache_dir)
    assert vae_cache.store.root == tmp_path / "sd15-tiny" / "vae"
    assert text_cache.store.root == tmp_path / "sd15-tiny" / "text"
    assert state.cache_dirs == sorted([tmp_path / "sd15-tiny" / "text", tmp_path / "sd15-tiny" / "vae"])
    text_cache.store.put_many({"k": {"embeds": torch.zeros(2, 3)}})
    assert len(state.delete_cache_files()) == 2
    assert not (tmp_path / "sd15-tiny" / "text").exists()


@pytest.mark.parametrize("tag", ["", "..", "a/b", ".hidden", "-x"])
def test_open_caches_rejects_path_like_tags(tmp_path, tag):
    with pytest.raises(ValueError, match="model_tag"):
        open_caches(tmp_path, tag)


def test_items_compute_cannot_encode_are_reported_not_stored(tmp_path):
    cache = TensorCache(ShardedTensorStore(tmp_path / "store"), "vae")

    def compute(payloads):
        return [None if p == "corrupt" else {"x": torch.ones(2)} for p in payloads]

    report = cache.fill([("a", "ok"), ("b", "corrupt"), ("c", "ok")], compute, batch_size=2)
    assert report.failed == ("b",)
    assert report.num_computed == 2
    assert "a" in cache and "c" in cache and "b" not in cache
    # Next fill tries the failed one again (it may have been fixed) and nothing else.
    again = cache.fill([("a", "ok"), ("b", "corrupt"), ("c", "ok")], compute, batch_size=2)
    assert again.num_hits == 2 and again.failed == ("b",)
