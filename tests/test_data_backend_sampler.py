"""BucketSampler: per-rank distinctness, coverage, one bucket per batch, determinism, resume."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from fakes import make_samples

from simpletuner.data_backend import BucketSampler

COUNTS = {
    ("a", (64, 64)): 13,
    ("a", (96, 48)): 9,
    ("a", (48, 96)): 2,  # smaller than one global batch of 4: never used
    ("b", (64, 64)): 8,  # same bucket as dataset a, but must never share a batch with it
}


def keys(batches):
    return [[s.key for s in batch] for batch in batches]


def test_one_bucket_and_one_dataset_per_batch():
    sampler = BucketSampler(make_samples(COUNTS), batch_size=3, seed=1)
    batches = list(sampler)
    assert batches and all(len(b) == 3 for b in batches)
    for batch in batches:
        assert len({(s.dataset_id, s.bucket) for s in batch}) == 1


def test_two_ranks_see_distinct_samples_and_cover_full_buckets_once():
    samples = make_samples(COUNTS)
    per_rank = [list(BucketSampler(samples, batch_size=2, num_replicas=2, rank=r, seed=5)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == len(BucketSampler(samples, 2, 2, 0, 5))
    seen = [s.key for batches in per_rank for batch in batches for s in batch]
    assert len(seen) == len(set(seen))  # no sample twice in an epoch, across ranks
    # Global batch 4: each group contributes floor(n / 4) * 4 samples.
    per_group = Counter((s.dataset_id, s.bucket) for batches in per_rank for batch in batches for s in batch)
    assert per_group == {("a", (64, 64)): 12, ("a", (96, 48)): 8, ("b", (64, 64)): 8}
    # The two ranks' i-th batches form one global batch: same dataset and bucket.
    for b0, b1 in zip(*per_rank):
        assert (b0[0].dataset_id, b0[0].bucket) == (b1[0].dataset_id, b1[0].bucket)


def test_every_sample_of_exact_buckets_used_once_per_epoch():
    samples = make_samples({("a", (64, 64)): 8, ("a", (32, 64)): 4})
    sampler = BucketSampler(samples, batch_size=2, seed=0)
    for _ in range(3):
        seen = [s.key for batch in sampler for s in batch]
        assert sorted(seen) == sorted(s.key for s in samples)


def test_deterministic_for_seed_and_different_across_epochs_and_seeds():
    samples = make_samples(COUNTS)
    a = BucketSampler(samples, batch_size=2, seed=11)
    b = BucketSampler(list(reversed(samples)), batch_size=2, seed=11)  # input order does not matter
    epoch0_a, epoch0_b = keys(a), keys(b)
    assert epoch0_a == epoch0_b
    assert a.epoch == 1
    epoch1 = keys(a)
    assert epoch1 != epoch0_a
    assert keys(BucketSampler(samples, batch_size=2, seed=12)) != epoch0_a


def test_len_counts_batches_per_rank():
    sampler = BucketSampler(make_samples(COUNTS), batch_size=2, num_replicas=2, rank=1)
    assert len(sampler) == 3 + 2 + 2
    assert len(list(sampler)) == len(sampler)


@pytest.mark.parametrize("stop_after", [0, 1, 5, 7])
def test_resume_reproduces_remaining_sequence(stop_after):
    samples = make_samples(COUNTS)
    reference = BucketSampler(samples, batch_size=2, num_replicas=2, rank=1, seed=3)
    uninterrupted = keys(reference) + keys(reference)  # two epochs

    first = BucketSampler(samples, batch_size=2, num_replicas=2, rank=1, seed=3)
    iterator = iter(first)
    consumed = [[s.key for s in next(iterator)] for _ in range(stop_after)]
    state = first.state_dict()
    assert state == {"epoch": 0, "batch_index": stop_after}

    resumed = BucketSampler(samples, batch_size=2, num_replicas=2, rank=1, seed=3)
    resumed.load_state_dict(state)
    rest = keys(resumed) + keys(resumed)
    assert consumed + rest[: len(uninterrupted) - stop_after] == uninterrupted


def test_resume_after_a_later_epoch():
    samples = make_samples(COUNTS)
    run = BucketSampler(samples, batch_size=3, seed=9)
    list(run)
    list(run)
    iterator = iter(run)
    next(iterator)
    expected_rest = keys(iterator)
    resumed = BucketSampler(samples, batch_size=3, seed=9)
    resumed.load_state_dict({"epoch": 2, "batch_index": 1})
    assert keys(resumed) == expected_rest


def test_set_epoch_restarts_that_epoch():
    samples = make_samples(COUNTS)
    sampler = BucketSampler(samples, batch_size=2, seed=0)
    epoch0 = keys(sampler)
    keys(sampler)
    sampler.set_epoch(0)
    assert keys(sampler) == epoch0


def test_load_state_dict_rejects_positions_that_do_not_fit():
    sampler = BucketSampler(make_samples(COUNTS), batch_size=2)
    with pytest.raises(ValueError, match="changed since the checkpoint"):
        sampler.load_state_dict({"epoch": 0, "batch_index": len(sampler) + 1})
    with pytest.raises(ValueError, match="batch_index"):
        sampler.load_state_dict({"epoch": 0})


def test_batch_larger_than_every_bucket_is_a_clear_error():
    samples = make_samples({("x", (64, 64)): 5, ("x", (96, 48)): 3})
    with pytest.raises(ValueError) as info:
        BucketSampler(samples, batch_size=4, num_replicas=2)
    message = str(info.value)
    assert "train_batch_size 4 x 2" in message and "= 8 samples per step" in message
    assert "dataset 'x', 64x64" in message and "only 5 images" in message
    assert "lower train_batch_size" in message


def test_small_buckets_are_reported_once(caplog):
    with caplog.at_level(logging.WARNING):
        BucketSampler(make_samples(COUNTS), batch_size=2, num_replicas=2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "2 sample(s) are never trained on" in warnings[0].getMessage()
    assert "48x96" in warnings[0].getMessage()


def test_invalid_arguments():
    samples = make_samples(COUNTS)
    with pytest.raises(ValueError, match="rank 2"):
        BucketSampler(samples, batch_size=1, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="batch_size"):
        BucketSampler(samples, batch_size=0)
    with pytest.raises(ValueError, match="no samples"):
        BucketSampler([], batch_size=1)
