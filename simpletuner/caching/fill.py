"""The cache fill of a training run (:func:`fill_caches`), in named phases (:class:`CacheFill`): the plan
(:class:`~simpletuner.caching.plan.CachePlan`), the latents, dropping the files that do not decode, the
text embeddings. With ``augmentations_cache_mode`` ``refresh_each_epoch`` or ``disable_cache`` no latent is
encoded here: every image is decoded once, so files that do not decode are dropped before the sampler is
built, and the VAE stays loaded (:attr:`FilledCaches.reencoder`).
"""

from __future__ import annotations

import functools
import math
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

import torch

from simpletuner.caching.base import RecordCacheDir
from simpletuner.caching.encoders import CacheEncoders, LazyEncoders, PairedPromptEncoder, StepMarker, no_step
from simpletuner.caching.keys import PairedCaption, TextId
from simpletuner.caching.plan import CachePlan
from simpletuner.caching.reencode import PixelLoader, Reencoder, batch_group, encode_loaded
from simpletuner.caching.routing import merge_fill_reports
from simpletuner.caching.share import FillShare
from simpletuner.caching.size_crop import SIZE_CROP_BYTES
from simpletuner.caching.tensor_cache import HEADER_BYTES_PER_TENSOR, FillReport, SourceCheck, TensorCache
from simpletuner.caching.vae_cache import sample_source_hash, sample_source_name
from simpletuner.data_backend import RegisteredDataset
from simpletuner.data_backend.base import SupportsShards
from simpletuner.data_backend.pairs import pixels_to_image, source_pixels

#: Captions encoded per text-encoder call while filling the cache.
TEXT_ENCODE_BATCH = 32


@dataclass(frozen=True)
class FilledCaches:
    """What a fill leaves for training to read (``CachedData`` in :mod:`simpletuner.training.batches`)."""

    vae_cache: TensorCache  # the default latent folder's cache (or the only one in use)
    dataset_vae_caches: dict[str, TensorCache]  # dataset id -> the cache of its latents
    text_cache: TensorCache
    latent_keys: dict[str, str]  # sample key -> latent key (``static`` mode; empty otherwise)
    text_keys: dict[TextId, str]  # of the captions the datasets still hold
    reports: dict[str, FillReport]  # "latents" / "text": what each phase found and encoded
    mode: str  # the cache mode in effect: static, refresh_each_epoch or disable_cache
    reencoder: Reencoder | None  # the latents encoded while training (holds the VAE); None when static
    prompt_sees_source: bool = True  # an edit pair's caption is keyed with its sample (``caching.keys.text_id``)


def _latent_sources(verify: bool) -> SourceCheck:
    """Each latent records a hash of its image's (clip's) bytes; ``verify`` re-checks the reused ones."""
    return SourceCheck(
        hash=lambda payload: sample_source_hash(payload[0].backend, payload[1]),
        name=lambda payload: sample_source_name(payload[0], payload[1]),
        verify=verify,
    )


def _latent_entry_bytes(spec: CacheEncoders) -> Callable[[tuple], int] | None:
    """payload -> about the bytes of its cached latent, from the model folder's configs alone (the
    VAE is not loaded): the family's latent at a square ``resolution`` bucket (float32, as
    ``encode_loaded`` stores it) gives the channels and the VAE's down factor, applied to the
    sample's own bucket; a clip's latent frames are the longest clip's scaled by its frame count; a masked sample's
    entry holds one float32 weight per latent pixel too.
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
        mask = cells * 4 + HEADER_BYTES_PER_TENSOR if sample.mask is not None else 0  # one float32 per latent pixel
        pixels = spec.pixel_entry_bytes(width, height)  # what the model keeps of the pixels (an SDXL ControlNet's)
        return channels * frames * cells * 4 + HEADER_BYTES_PER_TENSOR + extras + mask + pixels

    return estimate


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


class CacheFill:
    """One run's cache fill after its :class:`~simpletuner.caching.plan.CachePlan`, in phases:
    :meth:`fill_latents`, :meth:`drop_undecodable`, :meth:`fill_text`, then :meth:`filled`."""

    def __init__(self, plan: CachePlan, spec: CacheEncoders, datasets: list[RegisteredDataset], encoders: LazyEncoders):
        self.plan, self.spec, self.datasets, self.encoders = plan, spec, datasets, encoders
        config = plan.config
        self.loader = PixelLoader(config, pin=config.dataloader_pin_memory and encoders.device.type == "cuda")
        self.vae_caches = dict(plan.vae_caches)
        self.text_cache = plan.text_cache
        self.text_keys: dict[TextId, str] = {}
        self.reencoder: Reencoder | None = None

    def fill_latents(self) -> FillReport:
        """``static``: encode every latent the run reads and its folder lacks, folder by folder, each under
        its writer lock. Otherwise decode every image once (nothing is encoded) and keep the VAE loaded."""
        plan = self.plan
        if plan.mode == "static":
            return merge_fill_reports([self._fill_latent_folder(folder) for folder in plan.vae_folders])
        self.reencoder = Reencoder(
            self.spec,
            self.encoders.get_vae(),
            self.loader,
            self.datasets,
            plan.cache_dir,
            plan.record_cache_dir,
            self.spec.image_encoder_identity(),
            plan.mode,
            plan.config.vae_batch_size,
        )
        return self.reencoder.probe([(ds, s, None) for ds, s in plan.keys.sources.values()])

    def _fill_latent_folder(self, folder: Path) -> FillReport:
        plan, cache_config = self.plan, self.plan.config.cache_config
        version = plan.keys.static_version
        items = [
            (plan.keys.latents[key], (ds, s, version))
            for key, (ds, s) in plan.keys.sources.items()
            if plan.folders.vae_folder(ds.id) == folder
        ]
        base = plan.folders.lock_base(folder)
        if base in plan.read_only:  # an image that does not decode is dropped, not needed
            has = self.vae_caches[folder].__contains__
            items = plan.read_only.present_items(base, has, items, "VAE latents", self._decodes)
        with (
            plan.read_only.refusing_writes(base),
            plan.writing(
                folder,
                self.vae_caches[folder],
                [key for key, _ in items],
                functools.partial(plan.open_vae, folder),
                may_rewrite=cache_config.verify_content,
            ) as cache,
        ):
            report = cache.fill(
                items,
                self._encode_latents,
                plan.config.vae_batch_size,
                group=batch_group,
                desc="VAE latents" if len(plan.vae_folders) == 1 else f"VAE latents ({folder})",
                prepare=self.loader.load_batch,
                prepare_workers=plan.config.dataloader_num_workers,
                sources=_latent_sources(cache_config.verify_content),
                entry_bytes=_latent_entry_bytes(self.spec),
                share=plan.share,
                locality=_shard_of,
            )
        self.vae_caches[folder] = cache
        return report

    def _decodes(self, payload: Any) -> bool:
        return self.loader.load(*payload) is not None

    def _encode_latents(self, loaded: Any) -> list[dict[str, torch.Tensor] | None]:
        return encode_loaded(self.spec, self.encoders.get_vae(), loaded)

    def drop_undecodable(self) -> None:
        """Leave out of every dataset the files no process could decode (the same on every process)."""
        undecodable = _every_rank_undecodable(self.loader.undecodable, self.plan.share)
        for ds in self.datasets:
            ds.metadata.drop_unreadable(
                ds.id,
                str(getattr(ds.backend, "root", ds.id)),  # a backend without a folder is named by the dataset
                undecodable.get(ds.id, {}),
                self.plan.config.max_bad_image_fraction,
            )

    def fill_text(self) -> FillReport:
        """Encode every caption the datasets still hold (after :meth:`drop_undecodable`) that the text
        folder lacks, under its writer lock."""
        plan = self.plan
        self.text_keys = plan.keys.texts_of(self.datasets)  # captions sorted
        items = [(key, caption) for caption, key in self.text_keys.items()]
        base = plan.folders.lock_base(plan.folders.text)
        if base in plan.read_only:
            items = plan.read_only.present_items(base, self.text_cache.__contains__, items, "text embeddings")
        with (
            plan.read_only.refusing_writes(base),
            plan.writing(plan.folders.text, self.text_cache, self.text_keys.values(), plan.open_text) as cache,
        ):
            report = cache.fill(
                items,
                self._encode_text,
                TEXT_ENCODE_BATCH,
                group=self._text_group,
                desc="text embeddings",
                share=plan.share,
            )
        self.text_cache = cache
        plan.read_only.log_used()
        return report

    def _encode_text(self, batch: list) -> list[dict[str, torch.Tensor]]:
        if isinstance(batch[0], PairedCaption):  # an edit pair's prompt: the caption with its source image
            sources = self.plan.keys.sources
            images = [pixels_to_image(source_pixels(sources[item.sample_key][1])) for item in batch]
            paired = cast(PairedPromptEncoder, self.spec)  # only an edit model's samples have a source
            out = paired.encode_prompts(self.encoders.get_text(), [item.caption for item in batch], images=images)
        else:
            out = self.spec.encode_prompts(self.encoders.get_text(), batch)
        return [{k: v.cpu() for k, v in entry.items()} for entry in out]

    def _text_group(self, item: Any) -> tuple:
        """A batch of pairs holds one source size (their prompts stack)."""
        if isinstance(item, PairedCaption):
            return ("pair", self.plan.keys.sources[item.sample_key][1].bucket)
        return ("caption",)

    def filled(self, latents: FillReport, text: FillReport) -> FilledCaches:
        """What training reads, with the reports of :meth:`fill_latents` and :meth:`fill_text`."""
        folders, caches = self.plan.folders, self.vae_caches
        by_dataset = {ds.id: caches[folders.vae_folder(ds.id)] for ds in self.datasets}
        default = caches.get(folders.default_vae) or next(iter(caches.values()))
        reports = {"latents": latents, "text": text}
        mode = self.plan.mode
        return FilledCaches(
            default,
            by_dataset,
            self.text_cache,
            self.plan.keys.latents,
            self.text_keys,
            reports,
            mode,
            self.reencoder,
            self.plan.keys.prompt_sees_source,
        )


def fill_caches(  # noqa: PLR0913
    spec: CacheEncoders,
    datasets: list[RegisteredDataset],
    cache_dir: Path,
    device: torch.device,
    text_dtype: torch.dtype,
    *,
    locks: ExitStack | None,
    record_cache_dir: RecordCacheDir,
    share: FillShare | None = None,
    step: StepMarker = no_step,
) -> tuple[FilledCaches, LazyEncoders]:
    """Encode every sample and caption of ``datasets`` not already cached under ``cache_dir``; returns
    what training reads and the encoders (those the fill loaded, on ``device``; text in ``text_dtype``).

    ``locks``: the run's lock stack, which the cache folders' locks are entered into (held until it
    closes; None: no run holds them). ``record_cache_dir``: called with each folder written to disk.
    ``share`` (:func:`~simpletuner.caching.share.launch_share`): the processes of a launch, which all call
    this; each encodes a part of what is missing, and the files that do not decode are known to all.
    ``step`` marks loading an encoder. A read-only cache folder is read without locks when it holds every
    entry the run needs, and stops the run before anything is encoded when it does not.
    """
    plan = CachePlan(spec, datasets, cache_dir, text_dtype, locks=locks, record_cache_dir=record_cache_dir, share=share)
    fill = CacheFill(plan, spec, datasets, LazyEncoders(spec, device, text_dtype, step))
    latents = fill.fill_latents()
    fill.drop_undecodable()
    text = fill.fill_text()
    return fill.filled(latents, text), fill.encoders
