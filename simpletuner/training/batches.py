"""Fill the latent and text-embedding caches, then serve training batches from them."""

from __future__ import annotations

import gc
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from simpletuner.caching import FillReport, ShardedTensorStore, TensorCache, open_caches
from simpletuner.caching.keys import cache_keys
from simpletuner.caching.layout import cache_base, epoch_folder
from simpletuner.caching.reencode import (
    DecodeThreads,
    EpochLatents,
    PixelLoader,
    Reencoder,
    batch_group,
    encode_loaded,
)
from simpletuner.caching.tensor_cache import HEADER_BYTES_PER_TENSOR, SourceCheck
from simpletuner.caching.vae_cache import sample_source_hash, sample_source_name
from simpletuner.data_backend import RegisteredDataset, Sample
from simpletuner.gh200.uvm import optimize_batch_for_gh200
from simpletuner.locks import CacheLocks, hold_epoch_folder
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
    """Maps samples to cache keys and reads batches: latents from the VAE cache, or, with
    augmentations in ``refresh_each_epoch`` / ``disable_cache`` mode, re-encoded while training
    (the VAE stays loaded: this object holds it). Text embeddings are always cached."""

    def __init__(
        self,
        vae_cache: TensorCache,
        text_cache: TensorCache,
        latent_keys: dict[str, str],
        text_keys: dict[str, str],
        fill_reports: dict[str, FillReport],
        mode: str = "static",
        reencoder: Reencoder | None = None,
    ):
        self.vae_cache = vae_cache
        self.text_cache = text_cache
        self.latent_keys = latent_keys  # static mode: sample key -> latent key
        self.text_keys = text_keys
        self.fill_reports = fill_reports  # "latents" / "text": hits and encodes of this run
        self.mode = mode  # static | refresh_each_epoch | disable_cache
        self._reencoder = reencoder

    @property
    def epoch_latents(self) -> EpochLatents | None:
        """``refresh_each_epoch``: the per-epoch latents (their cache and refresh reports)."""
        return self._reencoder.epochs if self._reencoder is not None else None

    @property
    def decode_threads(self) -> DecodeThreads | None:
        """The decoding threads used while training (re-encoding modes only)."""
        return self._reencoder.threads if self._reencoder is not None else None

    def _prepared(self, latents: torch.Tensor, samples: list[Sample], device: torch.device) -> Batch:
        """The one place a micro-batch is finished: stacked text embeddings joined to the latents,
        then the GH200 batch hook, once, on the stacked fields (``optimize_batch_for_gh200``: residency
        advice by role and a prefetch to ``device`` for those in managed memory, i.e. from a
        `unified_memory` cache; it returns at once when hints are off or there is no CUDA)."""
        cond = self.text_cache.get_batch([self.text_keys[s.caption] for s in samples])
        fields = {
            "latents": latents.to(device, non_blocking=True),
            "conditioning": {k: v.to(device, non_blocking=True) for k, v in cond.items()},
        }
        optimize_batch_for_gh200(fields, device)
        return Batch(fields["latents"], fields["conditioning"], samples)

    def _from_cache(self, cache: TensorCache, keys: dict[str, str], samples: list[Sample], device) -> Batch:
        return self._prepared(cache.get_batch([keys[s.key] for s in samples])["latents"], samples, device)

    def batch(self, samples: list[Sample], device: torch.device) -> Batch:
        """The micro-batch of ``samples`` outside the training order (evaluation, FLOP counting):
        cached latents, or, when latents are re-encoded while training, encoded now with one fixed
        augmentation version (``"eval"``), the same on every call."""
        if self._reencoder is None:
            return self._from_cache(self.vae_cache, self.latent_keys, samples, device)
        return self._prepared(self._reencoder.encode(samples, ["eval"] * len(samples), device), samples, device)

    def iterate(self, sampler, device: torch.device) -> Iterator[Batch]:
        """Micro-batches forever, epoch after epoch; the sampler keeps the position.

        ``refresh_each_epoch`` re-encodes the epoch's latents before its first batch is read;
        ``disable_cache`` encodes every batch as it is read, decoding ahead on the loader threads.
        """
        while True:
            epoch = sampler.epoch + 1 if sampler.batch_index >= len(sampler) else sampler.epoch
            if self.mode == "disable_cache":
                for samples, latents in self._reencoder.iterate_epoch(sampler, epoch, device):
                    yield self._prepared(latents, samples, device)
                continue
            if self.mode == "refresh_each_epoch":
                keys = self._reencoder.epochs.prepare(sampler, epoch)
                cache = self._reencoder.epochs.cache
            else:
                cache, keys = self.vae_cache, self.latent_keys
            for samples in sampler:
                yield self._from_cache(cache, keys, samples, device)

    def close(self) -> None:
        """Stop the persistent decoding threads, if any."""
        if self._reencoder is not None:
            self._reencoder.threads.close()


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


def _cache_mode(config) -> str:
    """The effective ``augmentations_cache_mode``: re-encoding without augmentations changes nothing."""
    mode = config.augmentations_cache_mode
    if mode == "refresh_each_epoch" and not config.augmentations.is_enabled:
        logger.warning(
            "augmentations_cache_mode 'refresh_each_epoch' without augmentations would re-encode the "
            "same latents every epoch: caching them once instead (`static`)"
        )
        return "static"
    return mode


def _latent_sources(verify: bool) -> SourceCheck:
    """Each latent records a hash of its image's (clip's) bytes; ``verify`` re-checks the reused ones."""
    return SourceCheck(
        hash=lambda payload: sample_source_hash(payload[0].backend, payload[1]),
        name=lambda payload: sample_source_name(payload[0], payload[1]),
        verify=verify,
    )


@contextmanager
def _writing(
    cache_locks: CacheLocks | None,
    cache: TensorCache,
    keys: Iterable[str],
    reopen: Callable[[], TensorCache],
    may_rewrite: bool = False,
) -> Iterator[TensorCache]:
    """Hold the cache folder's writer lock while ``cache`` gets the ``keys`` it lacks, so two runs
    sharing the folder never encode an entry twice (nothing to hold when every key is there, or
    the caches live in memory only; ``may_rewrite``, i.e. ``verify_content``, always holds it: the
    fill may re-encode present entries). Yields the cache to fill: once the lock is held it is
    brought up to date with what other runs stored since it was opened (a disk store indexes their
    new shards, a memory store is opened again), so only what is still missing gets encoded."""
    if cache_locks is None or (not may_rewrite and all(key in cache for key in keys)):
        yield cache
        return
    with cache_locks.writing():
        if isinstance(cache.store, ShardedTensorStore):
            cache.store.refresh()
        else:
            cache = reopen()
        yield cache


def _latent_entry_bytes(spec: ModelSpec) -> Callable[[tuple], int] | None:
    """payload -> about the bytes of its cached latent, from the model folder's configs alone (the
    VAE is not loaded): the family's latent at a square ``resolution`` bucket (float32, as
    ``encode_loaded`` stores it) gives the channels and the VAE's down factor, applied to the
    sample's own bucket; a clip's latent frames are the longest clip's scaled by its frame count.
    None when the family does not describe its shapes: the fill then measures its first batch."""
    try:
        shape, _ = spec.batch_shapes(1)
    except (NotImplementedError, ValueError, KeyError, TypeError, OSError):
        return None
    factor = spec.config.resolution / shape[-1]  # pixels per latent cell along a side
    channels = shape[1]
    latent_frames = shape[2] if len(shape) == 5 else 1  # of the longest clip the config trains on
    longest = max((d.num_frames or 1 for d in spec.config.datasets or [] if d.dataset_type == "video"), default=1)

    def estimate(payload: tuple) -> int:
        sample = payload[1]
        width, height = sample.bucket
        frames = math.ceil(latent_frames * max(sample.num_frames, 1) / longest)
        cells = math.ceil(width / factor) * math.ceil(height / factor)
        return channels * frames * cells * 4 + HEADER_BYTES_PER_TENSOR

    return estimate


def _epoch_folder(base: Path) -> Path:
    """This process's folder of per-epoch latents (as :class:`Reencoder` names it from the sampler's rank)."""
    from accelerate import PartialState

    process = PartialState()
    return epoch_folder(base, process.process_index, process.num_processes)


def prepare_caches(
    spec: ModelSpec,
    datasets: list[RegisteredDataset],
    cache_dir: Path,
    device: torch.device,
    text_dtype: torch.dtype,
    state=None,
) -> tuple[CachedData, _LazyEncoders]:
    """Encode every sample and caption not already cached; returns the data and any loaded encoders.

    With ``augmentations_cache_mode`` ``refresh_each_epoch`` or ``disable_cache`` no latent is
    encoded here: every image is decoded once instead, so files that do not decode are dropped
    before the sampler is built; the VAE is loaded and kept by the returned data.

    Locks (simpletuner/locks.py), for caches on disk: the cache folder is held shared from here
    until the run ends (added to ``state.run_locks``, the Trainer's, when there is one), each fill
    with something to encode holds the folder's writer lock (a second run waits, then encodes only
    what is still missing), and ``refresh_each_epoch`` holds this process's per-epoch folder.
    """
    cache = spec.config.cache_config
    vae_cache, text_cache = open_caches(
        cache_dir, spec.family, state, cache.vae_cache_type, cache.text_cache_type, cache.persistent_cache
    )
    on_disk = cache.persistent_cache or "disk" in (cache.vae_cache_type, cache.text_cache_type)
    cache_locks = CacheLocks(cache_base(cache_dir, spec.family)) if on_disk else None
    run_locks = getattr(state, "run_locks", None)  # the Trainer's, released when train() ends
    if cache_locks is not None and run_locks is not None:  # in use from here: `cache clear` refuses
        run_locks.enter_context(cache_locks.use())

    def reopen() -> tuple[TensorCache, TensorCache]:
        return open_caches(
            cache_dir, spec.family, state, cache.vae_cache_type, cache.text_cache_type, cache.persistent_cache
        )

    encoders = _LazyEncoders(spec, device, text_dtype)
    config = spec.config
    mode = _cache_mode(config)
    loader = PixelLoader(config, pin=config.dataloader_pin_memory and device.type == "cuda")

    keys = cache_keys(spec, datasets, text_dtype, latents=mode == "static")  # what `simpletuner cache` counts
    distinct = keys.sources  # sample key -> (dataset, sample); repeats share one cache entry
    latent_keys = keys.latents
    if mode == "static":
        version = keys.static_version
        with _writing(
            cache_locks, vae_cache, latent_keys.values(), lambda: reopen()[0], may_rewrite=cache.verify_content
        ) as vae_cache:
            latent_report = vae_cache.fill(
                [(latent_keys[key], (ds, s, version)) for key, (ds, s) in distinct.items()],
                lambda loaded: encode_loaded(spec, encoders.get_vae(), loaded),
                VAE_ENCODE_BATCH,
                group=batch_group,
                desc="VAE latents",
                prepare=loader.load_batch,
                prepare_workers=config.dataloader_num_workers,
                sources=_latent_sources(cache.verify_content),
                entry_bytes=_latent_entry_bytes(spec),
            )
        reencoder = None
    else:  # latents are encoded while training; decode everything once now to drop unreadable files
        if (
            mode == "refresh_each_epoch"
            and run_locks is not None
            and (cache.persistent_cache or cache.vae_cache_type == "disk")
        ):
            run_locks.enter_context(hold_epoch_folder(_epoch_folder(cache_base(cache_dir, spec.family))))
        reencoder = Reencoder(
            spec,
            encoders.get_vae(),
            loader,
            datasets,
            Path(cache_dir).expanduser(),
            state,
            spec.image_encoder_identity(),
            mode,
            VAE_ENCODE_BATCH,
        )
        latent_report = reencoder.probe([(ds, s, None) for ds, s in distinct.values()])
    for ds in datasets:
        ds.metadata.drop_unreadable(
            ds.id,
            str(getattr(ds.backend, "root", ds.id)),
            loader.undecodable.get(ds.id, {}),
            config.max_bad_image_fraction,
        )

    text_keys = keys.texts_of(datasets)  # after dropping undecodable ones; captions sorted

    def encode_text(batch: list[str]) -> list[dict[str, torch.Tensor]]:
        out = spec.encode_prompts(encoders.get_text(), batch)
        return [{k: v.cpu() for k, v in entry.items()} for entry in out]

    with _writing(cache_locks, text_cache, text_keys.values(), lambda: reopen()[1]) as text_cache:
        text_report = text_cache.fill(
            [(key, caption) for caption, key in text_keys.items()],
            encode_text,
            TEXT_ENCODE_BATCH,
            desc="text embeddings",
        )
    reports = {"latents": latent_report, "text": text_report}
    return CachedData(vae_cache, text_cache, latent_keys, text_keys, reports, mode, reencoder), encoders


def free_memory() -> None:
    """Collect garbage and return cached GPU memory (after the caller dropped its references)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
