"""Decoding (and augmenting) images for the VAE, and re-encoding them while training.

:class:`PixelLoader` decodes a batch of samples and applies their augmentation version; the
start-up cache fill and both re-encoding cache modes use it. :class:`DecodeThreads` is the
``dataloader_num_workers`` thread pool (one for the whole run with
``dataloader_persistent_workers``). :class:`EpochLatents` is ``augmentations_cache_mode:
refresh_each_epoch``: at each epoch's start this process's samples of that epoch are encoded
with version = epoch into a folder only this process writes, the previous version is removed,
and a completion marker says the version is whole.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
from PIL import Image

from simpletuner.caching.base import RecordCacheDir
from simpletuner.caching.encoders import CacheEncoders
from simpletuner.caching.keys import epoch_latent_key
from simpletuner.caching.layout import cache_base, epoch_folder
from simpletuner.caching.opening import open_tensor_cache
from simpletuner.caching.size_crop import SIZE_CROP, SizeCrop, size_crop_of, size_crop_tensor
from simpletuner.caching.tensor_cache import FillReport, TensorCache
from simpletuner.caching.threads import run_ahead
from simpletuner.data_backend import RegisteredDataset, Sample, load_sample_pixels
from simpletuner.data_backend.augment import apply_params, draw_params
from simpletuner.data_backend.masks import MASK_KEY, augment_mask, latent_mask, mask_pixels

logger = logging.getLogger(__name__)

#: ``(dataset, sample, augmentation version or None for none)``: what the loader decodes.
Payload = tuple[RegisteredDataset, Sample, Any]


#: A decoded payload's mask (masked loss): ``[1, H, W]`` weights cut as its pixels, and whether it is read as
#: ``segmentation``; None for a sample without a mask.
Mask = tuple[torch.Tensor, bool] | None


class Decoded(NamedTuple):
    """One payload decoded: its pixels, their size and crop, and its mask cut the same way."""

    pixels: torch.Tensor
    size_crop: SizeCrop
    mask: Mask = None


class Loaded(NamedTuple):
    """One VAE batch decoded: per payload whether it decoded, the stacked pixels of those that did (None:
    none did), their size and crop (:func:`~simpletuner.caching.size_crop.size_crop_of`) and masks, in order."""

    ok: list[bool]
    pixels: torch.Tensor | None
    size_crops: list[SizeCrop]
    masks: tuple[Mask, ...] = ()


def batch_group(payload: Payload) -> tuple:
    """Payloads that can be stacked into one VAE batch share this (dataset, bucket)."""
    return payload[0].id, payload[1].bucket


class PixelLoader:
    """Decodes samples into VAE input, applying each payload's augmentation version; files whose
    body cannot be decoded are recorded in ``undecodable`` (dataset id -> {path: reason}).
    Thread-safe: batches are decoded on loader threads."""

    def __init__(self, config, pin: bool = False):
        self.augmentations = config.augmentations
        self.seed = config.seed
        self.pin = pin
        self.undecodable: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def load(self, dataset: RegisteredDataset, sample: Sample, version: Any) -> Decoded | None:
        """``[3, (F,) H, W]`` pixels in [-1, 1] (augmented unless ``version`` is None), the size and crop of
        what they show (:func:`~simpletuner.caching.size_crop.size_crop_of`) and the sample's mask given the same
        crop and flip (:func:`~simpletuner.data_backend.masks.mask_pixels`), or None when a file does not decode."""
        part = "image"
        try:
            pixels, info = load_sample_pixels(dataset, sample)
            part = "mask"
            mask = mask_pixels(sample) if sample.mask is not None else None
        except (OSError, ValueError, Image.DecompressionBombError) as exc:  # header was fine, body is not
            reason = str(exc) if isinstance(exc, ValueError) else f"cannot decode {part}: {exc}"
            if part == "mask":
                reason = f"its mask {sample.mask}: {reason}"
            with self._lock:
                self.undecodable.setdefault(dataset.id, {})[sample.path] = reason
            return None
        binary = sample.mask_type == "segmentation"
        if version is None or not self.augmentations.is_enabled:
            return Decoded(pixels, size_crop_of(info), None if mask is None else (mask, binary))
        params = draw_params(self.augmentations, self.seed, sample.key, version)
        masked = None if mask is None else (augment_mask(mask, params), binary)
        return Decoded(apply_params(pixels, params), size_crop_of(info, params), masked)

    def load_batch(self, payloads: list[Payload]) -> Loaded:
        """One VAE batch decoded (:class:`Loaded`)."""
        loaded = [self.load(*payload) for payload in payloads]
        good = [item for item in loaded if item is not None]
        stacked = torch.stack([item.pixels for item in good]) if good else None
        if stacked is not None and self.pin:
            stacked = stacked.pin_memory()
        return Loaded(
            [item is not None for item in loaded],
            stacked,
            [item.size_crop for item in good],
            tuple(item.mask for item in good),
        )

    def require(self, payloads: list[Payload], loaded: Loaded) -> torch.Tensor:
        """The stacked pixels of a batch that must decode whole (while training).

        Raises:
            ValueError: a file no longer decodes (it did at start-up), naming it and why.
        """
        if loaded.pixels is not None and all(loaded.ok):
            return loaded.pixels
        raise ValueError(self.failure_message([p for p, good in zip(payloads, loaded.ok) if not good]))

    def failure_message(self, failed: list[Payload]) -> str:
        """Why these payloads could not be decoded while training, and what to do."""
        named = "; ".join(
            f"{s.key}: {self.undecodable.get(ds.id, {}).get(s.path, 'cannot decode')}" for ds, s, _ in failed
        )
        return (
            f"cannot decode {named} although it decoded at start-up: restore the file, or start training again "
            "so that start-up drops it"
        )


def latent_extras(spec: CacheEncoders, loaded: Loaded, latents: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a latent entry of ``spec`` holds beside ``latents`` (the batch's, encoded), stacked for the decoded
    payloads of ``loaded``: :data:`~simpletuner.caching.size_crop.SIZE_CROP` for a model conditioned on it, what the
    model keeps of the pixels themselves (``spec.pixel_entries``), and
    :data:`~simpletuner.data_backend.masks.MASK_KEY` (``[N, 1, h, w]`` on the latents' grid) when a payload has a
    mask (one without trains on all of its pixels: weight 1)."""
    if loaded.pixels is None:
        return {}
    extras: dict[str, torch.Tensor] = {}
    if spec.conditions_on_size_crop:
        extras[SIZE_CROP] = size_crop_tensor(loaded.size_crops)
    extras.update(spec.pixel_entries(loaded.pixels))  # e.g. an SDXL ControlNet's conditioning image, as uint8
    if any(mask is not None for mask in loaded.masks):
        size = loaded.pixels.shape[-2:]
        weights = torch.stack([mask[0] if mask is not None else torch.ones(1, *size) for mask in loaded.masks])
        binary = torch.tensor([mask is not None and mask[1] for mask in loaded.masks])
        extras[MASK_KEY] = latent_mask(weights, (latents.shape[-2], latents.shape[-1]), binary).to(latents.device)
    return extras


def encode_loaded(spec: CacheEncoders, vae: Any, loaded: Loaded) -> list[dict[str, torch.Tensor] | None]:
    """The cache entry (float32, CPU) of each payload of a loaded batch: its VAE latents and
    :func:`latent_extras`; None for the undecodable ones."""
    if loaded.pixels is None:
        return [None] * len(loaded.ok)
    latents = spec.encode_images(vae, loaded.pixels).float().cpu()
    fields = {"latents": latents, **latent_extras(spec, loaded, latents)}
    entries: list[dict[str, torch.Tensor] | None] = []
    row = 0
    for good in loaded.ok:
        entries.append({name: values[row] for name, values in fields.items()} if good else None)
        row += good
    return entries


class DecodeThreads:
    """The ``dataloader_num_workers`` decoding threads. With ``persistent`` one pool is started on
    first use and kept for the run (``dataloader_persistent_workers``); otherwise every
    :meth:`use` starts one and shuts it down after. ``num_started`` counts pools started."""

    def __init__(self, num_workers: int, persistent: bool):
        self.num_workers = num_workers
        self.is_persistent = persistent
        self.num_started = 0
        self._pool: ThreadPoolExecutor | None = None

    def _start(self) -> ThreadPoolExecutor:
        self.num_started += 1
        return ThreadPoolExecutor(self.num_workers, thread_name_prefix="decode")

    @contextmanager
    def use(self) -> Iterator[ThreadPoolExecutor | None]:
        """A pool for one pass (a refresh, an epoch of batches); None with no workers (inline)."""
        if self.num_workers < 1:
            yield None
        elif self.is_persistent:
            if self._pool is None:
                self._pool = self._start()
            yield self._pool
        else:
            pool = self._start()
            try:
                yield pool
            finally:
                pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """Stop the persistent pool (a later :meth:`use` starts a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def epoch_batches(sampler, epoch: int) -> list[list[Sample]]:
    """This process's micro-batches of ``epoch``, from a copy of ``sampler`` (whose position is
    left untouched)."""
    peek = copy.copy(sampler)
    peek.set_epoch(epoch)
    return list(peek)


def _digest(keys: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()


class EpochLatents:
    """``refresh_each_epoch``: the latents of one epoch's version, re-encoded at its start.

    Args:
        open_cache: ``(rank, num_replicas) -> TensorCache`` of the folder this process alone
            writes (so processes never touch each other's files); opened on first use.
        key_for: ``(sample, version) -> latent key``.
        datasets: registered datasets by id.
        loader, threads: decode (and augment) on the ``dataloader_num_workers`` threads.
        encode: ``Loaded -> list[entry | None]`` (the VAE).
    """

    def __init__(
        self,
        open_cache: Callable[[int, int], TensorCache],
        key_for: Callable[[Sample, int], str],
        datasets: dict[str, RegisteredDataset],
        loader: PixelLoader,
        threads: DecodeThreads,
        encode: Callable[[Loaded], list[dict[str, torch.Tensor] | None]],
        batch_size: int,
    ):
        self._open_cache, self._key_for = open_cache, key_for
        self._datasets, self._loader, self._threads, self._encode = datasets, loader, threads, encode
        self._batch_size = batch_size
        self.cache: TensorCache | None = None
        self.reports: dict[int, FillReport] = {}  # epoch -> what its refresh did (this run)

    def prepare(self, sampler, epoch: int) -> dict[str, str]:
        """Make the latents of ``epoch`` (this process's samples of it) whole; returns sample key ->
        latent key. A version is trusted only with its completion marker (naming exactly these
        keys) and every entry present; otherwise every entry in the folder is removed and the
        version is encoded again from scratch, so an interrupted refresh is never used."""
        if self.cache is None:
            self.cache = self._open_cache(sampler.rank, sampler.num_replicas)
        cache, store = self.cache, self.cache.store
        samples = {s.key: s for batch in epoch_batches(sampler, epoch) for s in batch}  # first repeat wins
        keys = {sample_key: self._key_for(sample, epoch) for sample_key, sample in samples.items()}
        marker_name = f"epoch-{epoch}"
        marker = store.read_marker(marker_name)
        is_complete = (
            marker is not None
            and marker.get("keys") == _digest(keys.values())
            and all(key in cache for key in keys.values())
        )
        # Markers go first: from here until the new one is written, no version counts as whole.
        for name in store.marker_names():
            if name != marker_name or not is_complete:
                store.remove_marker(name)
        wanted = set(keys.values()) if is_complete else set()
        stale = [key for key in store.keys() if key not in wanted]
        if stale:
            cache.remove(stale)
            logger.info("removed %d latents of other epochs from %s", len(stale), store.root)
        items = [(keys[k], (self._datasets[s.dataset_id], s, epoch)) for k, s in samples.items()]
        with self._threads.use() as pool:
            report = cache.fill(
                items,
                self._encode,
                self._batch_size,
                group=batch_group,
                desc=f"VAE latents, epoch {epoch}",
                prepare=self._loader.load_batch,
                prepare_workers=self._threads.num_workers,
                prepare_pool=pool,
            )
        if report.failed:
            failed = set(report.failed)
            raise ValueError(self._loader.failure_message([p for k, p in items if k in failed]))
        store.write_marker(marker_name, {"epoch": epoch, "keys": _digest(keys.values()), "num_entries": len(keys)})
        self.reports[epoch] = report
        return keys


class Reencoder:
    """Latents encoded while training: ``refresh_each_epoch`` (:attr:`epochs`) or ``disable_cache``
    (:meth:`iterate_epoch`). Holds the VAE, so it stays loaded after start-up.

    ``loader`` decodes and augments; per-epoch latents go to ``<cache_dir>/<family>/vae-epochs/rank-<r>-of-<n>``
    (:func:`~simpletuner.caching.layout.epoch_folder`), passed to ``record_cache_dir`` (or None) when on disk;
    ``image_identity`` is the VAE's identity for latent keys; ``batch_size`` images per VAE call when refreshing.
    """

    def __init__(  # noqa: PLR0913
        self,
        spec: CacheEncoders,
        vae: Any,
        loader: PixelLoader,
        datasets: list[RegisteredDataset],
        cache_dir: Path,
        record_cache_dir: RecordCacheDir | None,
        image_identity: str,
        mode: str,
        batch_size: int,
    ):
        config = spec.config
        self.spec, self.vae, self.loader, self.batch_size = spec, vae, loader, batch_size
        self.threads = DecodeThreads(config.dataloader_num_workers, config.dataloader_persistent_workers)
        self._datasets = {ds.id: ds for ds in datasets}
        cache_cfg = config.cache_config

        def open_cache(rank: int, num_replicas: int) -> TensorCache:
            folder = epoch_folder(cache_base(cache_dir, spec.family), rank, num_replicas)
            persistent = cache_cfg.vae_cache_type == "disk" or cache_cfg.persistent_cache
            if record_cache_dir is not None and persistent:
                record_cache_dir(folder)
            return open_tensor_cache(folder, cache_cfg.vae_cache_type, "vae-epoch", cache_cfg.persistent_cache)

        size_crop = spec.conditions_on_size_crop

        def key_for(sample: Sample, version: int) -> str:
            dataset = self._datasets[sample.dataset_id]
            return epoch_latent_key(config, image_identity, dataset, sample, version, size_crop)

        self.epochs: EpochLatents | None = None
        if mode == "refresh_each_epoch":
            self.epochs = EpochLatents(
                open_cache,
                key_for,
                self._datasets,
                loader,
                self.threads,
                lambda loaded: encode_loaded(spec, vae, loaded),
                batch_size,
            )

    def probe(self, payloads: list[Payload]) -> FillReport:
        """Decode every payload once (nothing is encoded) so undecodable files are known at start-up."""
        started = time.perf_counter()
        groups: dict[tuple, list[Payload]] = {}
        for payload in payloads:
            groups.setdefault(batch_group(payload), []).append(payload)
        chunks = [g[i : i + self.batch_size] for g in groups.values() for i in range(0, len(g), self.batch_size)]
        failed: list[str] = []
        with self.threads.use() as pool:
            for chunk, loaded in zip(
                chunks, run_ahead(pool, self.loader.load_batch, chunks, 2 * self.threads.num_workers)
            ):
                failed += [sample.key for (_, sample, _), good in zip(chunk, loaded.ok) if not good]
        return FillReport(len(payloads), 0, 0, time.perf_counter() - started, failed=tuple(failed))

    def encode(self, samples: list[Sample], versions: list[Any], device: torch.device) -> dict[str, torch.Tensor]:
        """``samples`` decoded and augmented now (version per sample), on ``device``: ``{"latents": ...}`` and
        what a cache entry holds beside them (:func:`latent_extras`), stacked."""
        payloads = [(self._datasets[s.dataset_id], s, v) for s, v in zip(samples, versions)]
        return self._encode(payloads, self.loader.load_batch(payloads), device)

    def _encode(self, payloads: list[Payload], loaded: Loaded, device: torch.device) -> dict[str, torch.Tensor]:
        pixels = self.loader.require(payloads, loaded)
        latents = self.spec.encode_images(self.vae, pixels).float()
        fields = {"latents": latents, **latent_extras(self.spec, loaded, latents)}
        return {name: values.to(device, non_blocking=True) for name, values in fields.items()}

    def iterate_epoch(
        self, sampler, epoch: int, device: torch.device
    ) -> Iterator[tuple[list[Sample], dict[str, torch.Tensor]]]:
        """``disable_cache``: ``(samples, fields)`` for the rest of ``epoch`` (``fields`` as :meth:`encode`
        returns them), each batch decoded (up to two per loader thread ahead), augmented with version
        ``"<epoch>.<batch>.<slot>"`` (a pure function of the position, so a resumed run reproduces it) and
        encoded as it is read."""
        planned = epoch_batches(sampler, epoch)
        start = 0 if sampler.batch_index >= len(sampler) else sampler.batch_index

        def payloads(position: int) -> list[Payload]:
            return [
                (self._datasets[s.dataset_id], s, f"{epoch}.{position}.{slot}")
                for slot, s in enumerate(planned[position])
            ]

        with self.threads.use() as pool:
            decoded = run_ahead(
                pool,
                lambda position: (position, self.loader.load_batch(payloads(position))),
                range(start, len(planned)),
                2 * self.threads.num_workers,
            )
            try:
                for samples in sampler:
                    position, loaded = next(decoded)
                    assert position == sampler.batch_index - 1 and samples == planned[position], "sampler order changed"
                    yield samples, self._encode(payloads(position), loaded, device)
            finally:
                decoded.close()
