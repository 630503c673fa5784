"""Fakes and small builders that more than one test module uses."""

from __future__ import annotations

import torch

from simpletuner.caching import latent_cache_key
from simpletuner.data_backend import Sample


class RecordingEncoder:
    """A fake VAE: each latent is filled with the payload's id, its shape follows the payload's
    bucket; records every call."""

    def __init__(self):
        self.calls: list[list[dict]] = []

    def __call__(self, payloads):
        self.calls.append(list(payloads))
        buckets = {p["bucket"] for p in payloads}
        assert len(buckets) == 1, f"a batch mixed buckets {buckets}"
        width, height = payloads[0]["bucket"]
        batch = torch.stack([torch.full((4, height // 8, width // 8), float(p["id"])) for p in payloads])
        return [{"latent": batch[i].half()} for i in range(len(payloads))]

    @property
    def num_computed(self):
        return sum(len(call) for call in self.calls)


def data_only_config(dataset: dict, max_bad: float = 0.05) -> dict:
    """A raw config for tests of the data scan alone: one dataset, no model folder to read
    (validate it with ``check_files=False``)."""
    return {
        "pretrained_model_name_or_path": "unused",
        "max_train_steps": 1,
        "resolution": 64,
        "aspect_bucket_alignment": 16,
        "max_bad_image_fraction": max_bad,
        "datasets": [dataset],
    }


class NanGradient(torch.autograd.Function):
    """Identity forward, NaN gradient: a finite loss whose gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def latent_items(n: int, indices=(), change=None) -> list[tuple[str, dict]]:
    """``n`` (latent key, payload) pairs for cache-fill tests, in two buckets (every third sample
    64x32); the samples at ``indices`` get ``change`` applied to their key fields."""
    items = []
    for i in range(n):
        bucket = (64, 64) if i % 3 else (64, 32)
        fields = dict(
            sample_key=f"img{i}.png",
            file_identity=f"{i}:1",
            bucket=bucket,
            crop={"top": 0},
            resolution=64,
            encoder_identity="vae-a",
            dtype="float16",
        )
        if i in indices:
            fields.update(change)
        items.append((latent_cache_key(**fields), {"id": i, "bucket": bucket}))
    return items


class SequentialShare:
    """The processes of a shared cache fill (:class:`~simpletuner.caching.share.FillShare`) run one
    after the other in this process: ``rank(0)`` records what rank 0 shares, ``rank(1)``, run after it,
    receives that; every rank sees every other rank's outcome as its own. Use a new one per fill."""

    def __init__(self, num_ranks: int = 2):
        self.num_ranks = num_ranks
        self.firsts: list = []

    def rank(self, rank: int):
        outer = self

        class _Rank:
            num_ranks = outer.num_ranks

            def __init__(self):
                self.rank = rank
                self._replay = list(outer.firsts)

            def from_first(self, value):
                if self.rank == 0:
                    outer.firsts.append(value)
                    return value
                return self._replay.pop(0)

            def from_all(self, value):
                return [value] * outer.num_ranks

        return _Rank()


def bucket_of(payload: dict):
    """The ``group`` function for :func:`latent_items`: one encoder batch per bucket."""
    return payload["bucket"]


def make_samples(counts: dict[tuple[str, tuple[int, int]], int]) -> list[Sample]:
    """``n`` samples per ``(dataset_id, bucket)`` of ``counts``, each trained at its bucket (no files)."""
    samples = []
    for (dataset_id, bucket), n in counts.items():
        for i in range(n):
            path = f"{bucket[0]}x{bucket[1]}/{i:03d}.png"
            samples.append(
                Sample(
                    key=f"{dataset_id}/{path}",
                    dataset_id=dataset_id,
                    path=path,
                    caption=f"img {i}",
                    original_size=bucket,
                    bucket=bucket,
                    crop_style="center",
                    crop_seed=i,
                )
            )
    return samples
