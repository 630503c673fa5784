"""Fill the latent and text-embedding caches, then serve training batches from them."""

from __future__ import annotations

import gc
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from PIL import Image

from simpletuner.caching import FillReport, TensorCache, caption_text_key, open_caches, sample_latent_key
from simpletuner.data_backend import RegisteredDataset, Sample, load_sample_pixels
from simpletuner.models import ModelSpec

logger = logging.getLogger(__name__)

#: Images encoded per VAE call while filling the cache.
VAE_ENCODE_BATCH = 8
TEXT_ENCODE_BATCH = 32


@dataclass
class Batch:
    """One micro-batch: latents, conditioning tensors, and the samples they came from."""

    latents: torch.Tensor
    conditioning: dict[str, torch.Tensor]
    samples: list[Sample]

    @property
    def num_samples(self) -> int:
        return len(self.samples)


class CachedData:
    """Maps samples to cache keys and reads batches from the caches."""

    def __init__(self, vae_cache: TensorCache, text_cache: TensorCache, latent_keys: dict[str, str],
                 text_keys: dict[str, str], fill_reports: dict[str, FillReport]):
        self.vae_cache = vae_cache
        self.text_cache = text_cache
        self.latent_keys = latent_keys
        self.text_keys = text_keys
        self.fill_reports = fill_reports  # "latents" / "text": hits and encodes of this run

    def batch(self, samples: list[Sample], device: torch.device) -> Batch:
        latents = self.vae_cache.get_batch([self.latent_keys[s.key] for s in samples])["latents"]
        cond = self.text_cache.get_batch([self.text_keys[s.caption] for s in samples])
        return Batch(
            latents=latents.to(device, non_blocking=True),
            conditioning={k: v.to(device, non_blocking=True) for k, v in cond.items()},
            samples=samples,
        )

    def iterate(self, sampler, device: torch.device) -> Iterator[Batch]:
        """Micro-batches forever, epoch after epoch; the sampler keeps the position."""
        while True:
            for samples in sampler:
                yield self.batch(samples, device)


class _LazyEncoders:
    """Load the VAE / text encoders only when there is something to encode."""

    def __init__(self, spec: ModelSpec, device: torch.device, text_dtype: torch.dtype):
        self.spec, self.device, self.text_dtype = spec, device, text_dtype
        self.vae = None
        self.text = None

    def get_vae(self):
        if self.vae is None:
            self.vae = self.spec.load_vae(self.device, torch.float32)
        return self.vae

    def get_text(self):
        if self.text is None:
            self.text = self.spec.load_text_encoders(self.device, self.text_dtype)
        return self.text


def prepare_caches(
    spec: ModelSpec,
    datasets: list[RegisteredDataset],
    cache_dir: Path,
    device: torch.device,
    text_dtype: torch.dtype,
    state=None,
) -> tuple[CachedData, _LazyEncoders]:
    """Encode every sample and caption not already cached; returns the data and any loaded encoders."""
    cache = spec.config.cache_config
    vae_cache, text_cache = open_caches(
        cache_dir, spec.family, state, cache.vae_cache_type, cache.text_cache_type, cache.persistent_cache
    )
    encoders = _LazyEncoders(spec, device, text_dtype)
    image_identity = spec.image_encoder_identity()
    text_identity = spec.text_encoder_identity()
    config = spec.config

    latent_items: list[tuple[str, tuple[RegisteredDataset, Sample]]] = []
    latent_keys: dict[str, str] = {}
    for ds in datasets:
        for sample in ds.samples:
            if sample.key in latent_keys:
                continue  # repeats share one cache entry
            key = sample_latent_key(ds, sample, image_identity, config.resolution)
            latent_keys[sample.key] = key
            latent_items.append((key, (ds, sample)))

    undecodable: dict[str, dict[str, str]] = {}  # dataset id -> {path: reason}
    undecodable_lock = threading.Lock()
    pin = config.dataloader_pin_memory and device.type == "cuda"

    def load_pixels(payloads: list[tuple[RegisteredDataset, Sample]]) -> tuple[list[bool], torch.Tensor | None]:
        """Decode a batch (on a loader thread when dataloader_num_workers > 0); None for bad bodies."""
        pixels: list[torch.Tensor | None] = []
        for ds, sample in payloads:
            try:
                pixels.append(load_sample_pixels(ds, sample)[0])
            except (OSError, ValueError, Image.DecompressionBombError) as exc:  # header was fine, body is not
                with undecodable_lock:
                    reason = str(exc) if isinstance(exc, ValueError) else f"cannot decode image: {exc}"
                undecodable.setdefault(ds.id, {})[sample.path] = reason
                pixels.append(None)
        good = [p for p in pixels if p is not None]
        stacked = torch.stack(good) if good else None
        if stacked is not None and pin:
            stacked = stacked.pin_memory()
        return [p is not None for p in pixels], stacked

    def encode_images(loaded: tuple[list[bool], torch.Tensor | None]) -> list[dict[str, torch.Tensor] | None]:
        ok, stacked = loaded
        if stacked is None:
            return [None] * len(ok)
        latents = iter(spec.encode_images(encoders.get_vae(), stacked).float().cpu())
        return [{"latents": next(latents)} if good else None for good in ok]

    latent_report = vae_cache.fill(
        latent_items, encode_images, VAE_ENCODE_BATCH, group=lambda p: (p[0].id, p[1].bucket), desc="VAE latents",
        prepare=load_pixels, prepare_workers=config.dataloader_num_workers,
    )
    for ds in datasets:
        ds.metadata.drop_unreadable(ds.id, str(getattr(ds.backend, "root", ds.id)), undecodable.get(ds.id, {}),
                                    config.max_bad_image_fraction)

    captions = sorted({s.caption for ds in datasets for s in ds.samples})  # after dropping undecodable ones
    text_keys = {c: caption_text_key(c, text_identity, text_dtype) for c in captions}

    def encode_text(batch: list[str]) -> list[dict[str, torch.Tensor]]:
        out = spec.encode_prompts(encoders.get_text(), batch)
        return [{k: v.cpu() for k, v in entry.items()} for entry in out]

    text_report = text_cache.fill([(text_keys[c], c) for c in captions], encode_text, TEXT_ENCODE_BATCH, desc="text embeddings")
    reports = {"latents": latent_report, "text": text_report}
    return CachedData(vae_cache, text_cache, latent_keys, text_keys, reports), encoders


def free_memory() -> None:
    """Collect garbage and return cached GPU memory (after the caller dropped its references)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
