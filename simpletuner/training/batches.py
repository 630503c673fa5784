"""Fill the latent and text-embedding caches, then serve training batches from them."""

from __future__ import annotations

import gc
import hashlib
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple

import torch

from simpletuner.caching import FillReport, ShardedTensorStore, TensorCache
from simpletuner.caching.keys import DROPPED_CAPTION, PairedCaption, cache_keys, text_id
from simpletuner.caching.layout import cache_base, epoch_folder
from simpletuner.caching.read_only import ReadOnlyCaches
from simpletuner.caching.reencode import (
    DecodeThreads,
    EpochLatents,
    PixelLoader,
    Reencoder,
    batch_group,
    encode_loaded,
)
from simpletuner.caching.routing import CacheFolders, merge_fill_reports, open_folder_cache
from simpletuner.caching.share import FillShare, shares_folder
from simpletuner.caching.size_crop import SIZE_CROP_BYTES
from simpletuner.caching.tensor_cache import HEADER_BYTES_PER_TENSOR, SourceCheck
from simpletuner.caching.vae_cache import sample_source_hash, sample_source_name
from simpletuner.data_backend import RegisteredDataset, Sample
from simpletuner.data_backend.base import SupportsShards
from simpletuner.data_backend.captions import caption_line_index
from simpletuner.data_backend.pairs import pixels_to_image, source_pixels
from simpletuner.gh200.uvm import optimize_batch_for_gh200
from simpletuner.locks import CacheLocks, hold_epoch_folder
from simpletuner.models import ModelSpec
from simpletuner.training.launch import from_every_process, from_main_process, probe_shared_folder
from simpletuner.training.reliability import run_step

logger = logging.getLogger(__name__)

#: Images encoded per VAE call while filling the cache: the default of the config's `vae_batch_size`.
VAE_ENCODE_BATCH = 8
TEXT_ENCODE_BATCH = 32


class CaptionDraw(NamedTuple):
    """The caption decisions of one training micro-batch, per sample: whether it trains with the empty caption
    (caption dropout; empty: none does) and the caption it trains with otherwise (the line drawn from a caption
    file of several lines; empty: each its own ``caption``)."""

    dropped: tuple[bool, ...] = ()
    captions: tuple[str, ...] = ()


@dataclass(frozen=True)
class CaptionDropout:
    """The per-draw caption decisions of training samples: ``caption_dropout_probability`` (which train with the
    empty caption instead of their own) and, for a caption file of several lines, which line each draw trains with
    (:func:`~simpletuner.data_backend.captions.caption_line_index`).

    Each decision is a pure function of the run's ``seed`` and the sample's place in the data order (epoch,
    micro-batch of the epoch, slot in the global batch) and key, so a resumed run (whose sampler resumes at
    the same place) drops exactly the captions the uninterrupted run would, and draws the same lines, on every
    process.
    """

    seed: int
    probability: float

    def is_dropped(self, epoch: int, position: int, slot: int, key: str) -> bool:
        """Whether the sample ``key`` at ``slot`` of micro-batch ``position`` of ``epoch`` loses its caption:
        a uniform draw in [0, 1) from sha256 of those values, below ``probability``."""
        if self.probability <= 0:
            return False
        text = f"caption-dropout\x00{self.seed}\x00{epoch}\x00{position}\x00{slot}\x00{key}"
        draw = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64
        return draw < self.probability

    def of_batch(self, sampler, samples: list[Sample]) -> CaptionDraw:
        """The decisions for ``samples``, the micro-batch ``sampler`` (a BucketSampler) has just yielded."""
        epoch = sampler.epoch
        position = sampler.batch_index - 1  # counted before the batch was yielded
        first_slot = sampler.rank * sampler.batch_size  # this process's slice of the global batch
        dropped: tuple[bool, ...] = ()
        if self.probability > 0:
            dropped = tuple(self.is_dropped(epoch, position, first_slot + i, s.key) for i, s in enumerate(samples))
        captions: tuple[str, ...] = ()
        if any(s.caption_lines for s in samples):
            captions = tuple(
                s.caption_lines[
                    caption_line_index(self.seed, epoch, position, first_slot + i, s.key, len(s.caption_lines))
                ]
                if s.caption_lines
                else s.caption
                for i, s in enumerate(samples)
            )
        return CaptionDraw(dropped, captions)


@dataclass
class Batch:
    """One micro-batch: latents, conditioning tensors, and the samples they came from.

    ``dropped_captions``: per sample, whether it trains with the empty caption (caption dropout); empty when
    none does (dropout off, or a batch outside the training order). ``captions``: per sample, the caption it
    trains with unless dropped, when a sample of the batch has a caption file of several lines (the line drawn
    for it); empty otherwise (each trains with its ``caption``)."""

    latents: torch.Tensor
    conditioning: dict[str, torch.Tensor]
    samples: list[Sample]
    dropped_captions: tuple[bool, ...] = ()
    captions: tuple[str, ...] = ()

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def is_regularisation_data(self) -> bool:
        """Whether the batch comes from a regularisation dataset (a batch holds one dataset)."""
        return bool(self.samples) and self.samples[0].is_regularisation_data


class CachedData:
    """Maps samples to cache keys and reads batches: latents from the VAE cache, or, with
    augmentations in ``refresh_each_epoch`` / ``disable_cache`` mode, re-encoded while training
    (the VAE stays loaded: this object holds it). Text embeddings are always cached."""

    #: The caption decisions of training batches (``iterate``): dropout and the line of a caption file of several
    #: lines. None: every sample trains with its own ``caption``.
    caption_dropout: CaptionDropout | None = None

    def __init__(
        self,
        vae_cache: TensorCache,
        text_cache: TensorCache,
        latent_keys: dict[str, str],
        text_keys: dict[str, str],
        fill_reports: dict[str, FillReport],
        mode: str = "static",
        reencoder: Reencoder | None = None,
        dataset_vae_caches: Mapping[str, TensorCache] | None = None,
    ):
        self.vae_cache = vae_cache  # the default latent folder's cache (or the only one in use)
        self.dataset_vae_caches = dict(dataset_vae_caches or {})  # dataset id -> its latents' cache
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

    def _prepared(
        self,
        image: dict[str, torch.Tensor],
        samples: list[Sample],
        device: torch.device,
        draw: CaptionDraw = CaptionDraw(),
    ) -> Batch:
        """The one place a micro-batch is finished: stacked text embeddings joined to the stacked latent
        entries ``image`` (``latents``, and what a model conditioned on each image's size and crop keeps beside
        them, which joins the conditioning: :mod:`simpletuner.caching.size_crop`), then the GH200 batch hook,
        once, on the stacked fields (``optimize_batch_for_gh200``: residency advice by role and a prefetch to
        ``device`` for those in managed memory, i.e. from a `unified_memory` cache; it returns at once when
        hints are off or there is no CUDA). A sample ``draw`` drops gets the empty caption's embeddings (its size
        and crop stay: the pipeline passes the same ones to both guidance branches), the others those of the
        caption ``draw`` gives them (their own when it gives none)."""
        dropped, captions = draw
        ids = [
            text_id(s, DROPPED_CAPTION if dropped and dropped[i] else captions[i] if captions else None)
            for i, s in enumerate(samples)
        ]
        cond = self.text_cache.get_batch([self.text_keys[i] for i in ids])
        cond.update((name, values) for name, values in image.items() if name != "latents")
        fields = {
            "latents": image["latents"].to(device, non_blocking=True),
            "conditioning": {k: v.to(device, non_blocking=True) for k, v in cond.items()},
        }
        optimize_batch_for_gh200(fields, device)
        return Batch(fields["latents"], fields["conditioning"], samples, dropped, captions)

    def _from_cache(
        self, cache: TensorCache, keys: dict[str, str], samples: list[Sample], device, draw: CaptionDraw = CaptionDraw()
    ) -> Batch:
        return self._prepared(cache.get_batch([keys[s.key] for s in samples]), samples, device, draw)

    def _draw(self, sampler, samples: list[Sample]) -> CaptionDraw:
        """The caption decisions of the training micro-batch ``samples`` ``sampler`` has just yielded."""
        return self.caption_dropout.of_batch(sampler, samples) if self.caption_dropout is not None else CaptionDraw()

    def _cached_latents(self, samples: list[Sample], device, draw: CaptionDraw = CaptionDraw()) -> Batch:
        """``samples``' latents from the folder of their dataset (``cache_dir_vae``); a training batch
        holds one dataset, so one folder; samples of several are read folder by folder, order kept."""
        caches = [self.dataset_vae_caches.get(s.dataset_id, self.vae_cache) for s in samples]
        if all(c is caches[0] for c in caches):
            return self._from_cache(caches[0], self.latent_keys, samples, device, draw)
        entries = [c.get_batch([self.latent_keys[s.key]]) for c, s in zip(caches, samples)]
        stacked = {name: torch.cat([entry[name] for entry in entries]) for name in entries[0]}
        return self._prepared(stacked, samples, device, draw)

    def batch(self, samples: list[Sample], device: torch.device) -> Batch:
        """The micro-batch of ``samples`` outside the training order (evaluation, FLOP counting):
        cached latents, or, when latents are re-encoded while training, encoded now with one fixed
        augmentation version (``"eval"``), the same on every call."""
        if self._reencoder is None:
            return self._cached_latents(samples, device)
        return self._prepared(self._reencoder.encode(samples, ["eval"] * len(samples), device), samples, device)

    def iterate(self, sampler, device: torch.device) -> Iterator[Batch]:
        """Micro-batches forever, epoch after epoch; the sampler keeps the position.

        ``refresh_each_epoch`` re-encodes the epoch's latents before its first batch is read;
        ``disable_cache`` encodes every batch as it is read, decoding ahead on the loader threads.
        """
        while True:
            epoch = sampler.epoch + 1 if sampler.batch_index >= len(sampler) else sampler.epoch
            if self.mode == "disable_cache":
                for samples, image in self._reencoder.iterate_epoch(sampler, epoch, device):
                    yield self._prepared(image, samples, device, self._draw(sampler, samples))
                continue
            if self.mode == "refresh_each_epoch":
                keys = self._reencoder.epochs.prepare(sampler, epoch)
                cache = self._reencoder.epochs.cache
                for samples in sampler:
                    yield self._from_cache(cache, keys, samples, device, self._draw(sampler, samples))
                continue
            for samples in sampler:
                yield self._cached_latents(samples, device, self._draw(sampler, samples))

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
            with run_step("load_vae", "loading the VAE"):  # a Ctrl-C here names it
                self.vae = self.spec.load_vae(self.device, torch.float32)
        return self.vae

    def get_text(self):
        if self.text is None:
            with run_step("load_text_encoders", "loading the text encoders"):
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
    share: FillShare | None = None,
) -> Iterator[TensorCache]:
    """Hold the cache folder's writer lock while ``cache`` gets the ``keys`` it lacks, so two runs
    sharing the folder never encode an entry twice (nothing to hold when every key is there, or
    the caches live in memory only; ``may_rewrite``, i.e. ``verify_content``, always holds it: the
    fill may re-encode present entries). Yields the cache to fill: once the lock is held it is
    brought up to date with what other runs stored since it was opened (a disk store indexes their
    new shards, a memory store is opened again), so only what is still missing gets encoded.
    In a fill shared by the processes of a launch (``share``) rank 0 holds the lock for them all."""
    if share is not None and share.rank != 0 and shares_folder(cache.store):
        yield cache  # rank 0 holds the lock for the launch; the shared fill tells this rank what is missing
        return
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
    extras = SIZE_CROP_BYTES + HEADER_BYTES_PER_TENSOR if spec.conditions_on_size_crop else 0  # SDXL's size and crop

    def estimate(payload: tuple) -> int:
        sample = payload[1]
        width, height = sample.bucket
        frames = math.ceil(latent_frames * max(sample.num_frames, 1) / longest)
        cells = math.ceil(width / factor) * math.ceil(height / factor)
        return channels * frames * cells * 4 + HEADER_BYTES_PER_TENSOR + extras

    return estimate


def _epoch_folder(base: Path) -> Path:
    """This process's folder of per-epoch latents (as :class:`Reencoder` names it from the sampler's rank)."""
    from accelerate import PartialState

    process = PartialState()
    return epoch_folder(base, process.process_index, process.num_processes)


def launch_share(accelerator) -> FillShare | None:
    """The processes of ``accelerator``'s launch as a cache fill's share; None for one process."""
    if accelerator.num_processes <= 1:
        return None

    class _LaunchShare:
        rank, num_ranks = accelerator.process_index, accelerator.num_processes

        def from_first(self, value):
            return from_main_process(accelerator, value)

        def from_all(self, value):
            return from_every_process(accelerator, value)

        def sees_one_folder(self, folder: Path) -> bool:
            """Whether every rank reads ``folder`` as rank 0 writes it (not a node-local disk at that path)."""
            failed, seen = probe_shared_folder(accelerator, folder)
            return failed is None and all(ok for ok, _ in seen)

    return _LaunchShare()


def _shard_of(payload: tuple) -> str | None:
    """The shard file (tar, parquet) a VAE payload's image lives in; None for a file of its own."""
    dataset, sample = payload[0], payload[1]
    if isinstance(dataset.backend, SupportsShards):
        return f"{dataset.id}/{dataset.backend.shard_of(sample.path)}"
    return None


def _every_rank_undecodable(
    undecodable: dict[str, dict[str, str]], share: FillShare | None
) -> dict[str, dict[str, str]]:
    """The files no rank could decode (each decoded only its part of the misses): dataset id -> {path: reason}."""
    if share is None:
        return undecodable
    merged: dict[str, dict[str, str]] = {}
    for part in share.from_all(undecodable):
        for dataset_id, files in part.items():
            merged.setdefault(dataset_id, {}).update(files)
    return merged


def prepare_caches(
    spec: ModelSpec,
    datasets: list[RegisteredDataset],
    cache_dir: Path,
    device: torch.device,
    text_dtype: torch.dtype,
    state=None,
    share: FillShare | None = None,
) -> tuple[CachedData, _LazyEncoders]:
    """Encode every sample and caption not already cached; returns the data and any loaded encoders.

    ``share`` (:func:`launch_share`): the processes of a launch; every one calls this, each encodes a
    part of what is missing into the shared cache folder (:mod:`simpletuner.caching.share`), and files
    that do not decode are known to all of them.

    With ``augmentations_cache_mode`` ``refresh_each_epoch`` or ``disable_cache`` no latent is
    encoded here: every image is decoded once instead, so files that do not decode are dropped
    before the sampler is built; the VAE is loaded and kept by the returned data.

    Locks (simpletuner/locks.py), for caches on disk: the cache folder is held shared from here
    until the run ends (added to ``state.run_locks``, the Trainer's, when there is one), each fill
    with something to encode holds the folder's writer lock (a second run waits, then encodes only
    what is still missing), and ``refresh_each_epoch`` holds this process's per-epoch folder. A latent
    folder of a dataset's own (``cache_dir_vae``) or a ``text_cache_dir`` holds its own locks, taken the same way.
    A cache folder this process cannot write (a read-only mount) is read without locks when it holds every
    entry the run needs, and stops the run before anything is encoded when it does not
    (:mod:`simpletuner.caching.read_only`).
    """
    cache = spec.config.cache_config
    config = spec.config
    mode = _cache_mode(config)
    folders = CacheFolders.of(config, spec.family, cache_dir)
    if mode != "static":  # latents are re-encoded while training: no latent folder is read
        folders = CacheFolders(folders.base, folders.default_vae, folders.text)
    vae_folders = folders.vae_folders(ds.id for ds in datasets)

    on_disk = cache.persistent_cache or "disk" in (cache.vae_cache_type, cache.text_cache_type)
    lock_bases = sorted({folders.lock_base(f) for f in [*vae_folders, folders.text]}) if on_disk else []
    read_only = ReadOnlyCaches(lock_bases)  # read without locks; everything needed must be there

    def open_vae(folder: Path) -> TensorCache:
        with read_only.refusing_writes(folders.lock_base(folder)):
            return open_folder_cache(folder, cache.vae_cache_type, "vae", cache.persistent_cache, state)

    def open_text() -> TensorCache:
        with read_only.refusing_writes(folders.lock_base(folders.text)):
            return open_folder_cache(folders.text, cache.text_cache_type, "text", cache.persistent_cache, state)

    vae_caches = {folder: open_vae(folder) for folder in vae_folders}
    text_cache = open_text()
    cache_locks = {base: CacheLocks(base) for base in lock_bases if base not in read_only}  # sorted: one order
    run_locks = getattr(state, "run_locks", None)  # the Trainer's, released when train() ends
    if run_locks is not None:  # in use from here: `cache clear` refuses
        for locks in cache_locks.values():
            run_locks.enter_context(locks.use())

    def locks_of(folder: Path) -> CacheLocks | None:
        return cache_locks.get(folders.lock_base(folder))

    written = [f for f in [*vae_folders, folders.text] if folders.lock_base(f) not in read_only]
    if share is not None and on_disk and not all(share.sees_one_folder(f) for f in written):
        logger.warning(
            "the cache folders (%s) are not one folder for every process (a node-local disk at that path on some "
            "node): every process fills the whole cache itself, one at a time per folder. Put cache_dir on a "
            "file system every node mounts to share the encoding (documentation/DISTRIBUTED.md)",
            folders.base,
        )
        share = None
    encoders = _LazyEncoders(spec, device, text_dtype)
    loader = PixelLoader(config, pin=config.dataloader_pin_memory and device.type == "cuda")

    keys = cache_keys(spec, datasets, text_dtype, latents=mode == "static")  # what `simpletuner cache` counts
    distinct = keys.sources  # sample key -> (dataset, sample); repeats share one cache entry
    latent_keys = keys.latents
    if mode == "static":
        version = keys.static_version
        reports = []
        for folder in vae_folders:  # each folder's latents under its own writer lock
            items = [
                (latent_keys[key], (ds, s, version))
                for key, (ds, s) in distinct.items()
                if folders.vae_folder(ds.id) == folder
            ]
            base = folders.lock_base(folder)
            if base in read_only:  # an image that does not decode is dropped, not needed
                has, decodes = vae_caches[folder].__contains__, lambda payload: loader.load(*payload) is not None
                items = read_only.present_items(base, has, items, "VAE latents", decodes)
            with (
                read_only.refusing_writes(base),
                _writing(
                    locks_of(folder),
                    vae_caches[folder],
                    [key for key, _ in items],
                    lambda folder=folder: open_vae(folder),
                    may_rewrite=cache.verify_content,
                    share=share,
                ) as filled,
            ):
                reports.append(
                    filled.fill(
                        items,
                        lambda loaded: encode_loaded(spec, encoders.get_vae(), loaded),
                        config.vae_batch_size,
                        group=batch_group,
                        desc="VAE latents" if len(vae_folders) == 1 else f"VAE latents ({folder})",
                        prepare=loader.load_batch,
                        prepare_workers=config.dataloader_num_workers,
                        sources=_latent_sources(cache.verify_content),
                        entry_bytes=_latent_entry_bytes(spec),
                        share=share,
                        locality=_shard_of,
                    )
                )
            vae_caches[folder] = filled
        latent_report = merge_fill_reports(reports)
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
            config.vae_batch_size,
        )
        latent_report = reencoder.probe([(ds, s, None) for ds, s in distinct.values()])
    undecodable = _every_rank_undecodable(loader.undecodable, share)
    for ds in datasets:
        ds.metadata.drop_unreadable(
            ds.id,
            str(getattr(ds.backend, "root", ds.id)),
            undecodable.get(ds.id, {}),
            config.max_bad_image_fraction,
        )

    text_keys = keys.texts_of(datasets)  # after dropping undecodable ones; captions sorted

    def encode_text(batch: list) -> list[dict[str, torch.Tensor]]:
        if isinstance(batch[0], PairedCaption):  # an edit pair's prompt: the caption with its source image
            images = [pixels_to_image(source_pixels(distinct[item.sample_key][1])) for item in batch]
            out = spec.encode_prompts(encoders.get_text(), [item.caption for item in batch], images=images)
        else:
            out = spec.encode_prompts(encoders.get_text(), batch)
        return [{k: v.cpu() for k, v in entry.items()} for entry in out]

    def text_group(item) -> tuple:  # a batch of pairs holds one source size (their prompts stack)
        return ("pair", distinct[item.sample_key][1].bucket) if isinstance(item, PairedCaption) else ("caption",)

    text_items = [(key, caption) for caption, key in text_keys.items()]
    text_base = folders.lock_base(folders.text)
    if text_base in read_only:
        text_items = read_only.present_items(text_base, text_cache.__contains__, text_items, "text embeddings")
    with (
        read_only.refusing_writes(text_base),
        _writing(locks_of(folders.text), text_cache, text_keys.values(), open_text, share=share) as text_cache,
    ):
        text_report = text_cache.fill(
            text_items,
            encode_text,
            TEXT_ENCODE_BATCH,
            group=text_group,
            desc="text embeddings",
            share=share,
        )
    read_only.log_used()
    reports = {"latents": latent_report, "text": text_report}
    by_dataset = {ds.id: vae_caches[folders.vae_folder(ds.id)] for ds in datasets}
    default = vae_caches.get(folders.default_vae) or next(iter(vae_caches.values()))
    data = CachedData(default, text_cache, latent_keys, text_keys, reports, mode, reencoder, by_dataset)
    data.caption_dropout = CaptionDropout(config.seed, config.caption_dropout_probability)
    return data, encoders


def free_memory() -> None:
    """Collect garbage and return cached GPU memory (after the caller dropped its references)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
