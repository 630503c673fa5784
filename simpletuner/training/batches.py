"""Training batches, served from the caches the fill left (:mod:`simpletuner.caching.fill`)."""

from __future__ import annotations

import gc
import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, NamedTuple

import torch

from simpletuner.caching import FillReport, TensorCache
from simpletuner.caching.fill import FilledCaches
from simpletuner.caching.keys import DROPPED_CAPTION, TextId, text_id
from simpletuner.caching.reencode import DecodeThreads, EpochLatents, Reencoder
from simpletuner.data_backend import Sample
from simpletuner.data_backend.captions import caption_line_index
from simpletuner.data_backend.masks import MASK_KEY, mask_draw
from simpletuner.gh200.uvm import optimize_batch_for_gh200


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

    def of_batch(self, sampler: Any, samples: list[Sample]) -> CaptionDraw:
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


@dataclass(frozen=True)
class MaskedLoss:
    """``masked_loss_probability``: whether a training micro-batch of a ``mask_type: segmentation`` dataset has its
    loss weighted by its masks; a ``mask`` dataset's masks always weight it (SimpleTuner, common.py:6409-6424).
    A pure function of the run's ``seed`` and the batch's place in the data order (epoch, micro-batch), so a
    resumed run and every process of a launch decide alike."""

    seed: int
    probability: float = 1.0

    def uses_mask(self, sampler: Any, samples: list[Sample]) -> bool:
        """Whether ``samples``, the micro-batch ``sampler`` has just yielded, keep their masks."""
        if self.probability >= 1 or not any(s.mask is not None and s.mask_type == "segmentation" for s in samples):
            return True
        return mask_draw(self.seed, sampler.epoch, sampler.batch_index - 1) < self.probability


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
    (the VAE stays loaded: this object holds it). Text embeddings are always cached (with ``train_text_encoder``
    the captions' token ids, which the model embeds in each step: models/text_encoder_lora.py).
    ``caption_dropout``: the caption decisions of training batches (``iterate``), dropout and the line of a
    caption file of several lines; None: every sample trains with its own ``caption``. ``masked_loss``: which
    training batches of a ``segmentation`` dataset keep their masks (None: every one)."""

    def __init__(  # noqa: PLR0913
        self,
        vae_cache: TensorCache,
        text_cache: TensorCache,
        latent_keys: dict[str, str],
        text_keys: Mapping[TextId, str],
        fill_reports: dict[str, FillReport],
        mode: str = "static",
        reencoder: Reencoder | None = None,
        dataset_vae_caches: Mapping[str, TensorCache] | None = None,
        caption_dropout: CaptionDropout | None = None,
        masked_loss: MaskedLoss | None = None,
        prompt_sees_source: bool = True,
    ):
        self.vae_cache = vae_cache  # the default latent folder's cache (or the only one in use)
        self.dataset_vae_caches = dict(dataset_vae_caches or {})  # dataset id -> its latents' cache
        self.text_cache = text_cache
        self.latent_keys = latent_keys  # static mode: sample key -> latent key
        self.text_keys = text_keys
        self.fill_reports = fill_reports  # "latents" / "text": hits and encodes of this run
        self.mode = mode  # static | refresh_each_epoch | disable_cache
        self._reencoder = reencoder
        self.caption_dropout = caption_dropout
        self.masked_loss = masked_loss
        self.prompt_sees_source = prompt_sees_source  # as the text ids were made (``caching.keys.text_id``)

    @classmethod
    def of(
        cls, filled: FilledCaches, caption_dropout: CaptionDropout | None, masked_loss: MaskedLoss | None = None
    ) -> CachedData:
        """The data of a cache fill (:func:`simpletuner.caching.fill.fill_caches`)."""
        return cls(
            filled.vae_cache,
            filled.text_cache,
            filled.latent_keys,
            filled.text_keys,
            filled.reports,
            filled.mode,
            filled.reencoder,
            filled.dataset_vae_caches,
            caption_dropout,
            masked_loss,
            filled.prompt_sees_source,
        )

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
        uses_mask: bool = True,
    ) -> Batch:
        """The one place a micro-batch is finished: stacked text embeddings joined to the stacked latent
        entries ``image`` (``latents``, and what a model conditioned on each image's size and crop keeps beside
        them, which joins the conditioning: :mod:`simpletuner.caching.size_crop`), then the GH200 batch hook,
        once, on the stacked fields (``optimize_batch_for_gh200``: residency advice by role and a prefetch to
        ``device`` for those in managed memory, i.e. from a `unified_memory` cache; it returns at once when
        hints are off or there is no CUDA). A sample ``draw`` drops gets the empty caption's embeddings (its size
        and crop stay: the pipeline passes the same ones to both guidance branches), the others those of the
        caption ``draw`` gives them (their own when it gives none). Without ``uses_mask`` the batch's masks
        (:data:`~simpletuner.data_backend.masks.MASK_KEY`) are left out: every latent pixel counts."""
        dropped, captions = draw
        ids = [
            text_id(
                s,
                DROPPED_CAPTION if dropped and dropped[i] else captions[i] if captions else None,
                self.prompt_sees_source,
            )
            for i, s in enumerate(samples)
        ]
        cond = self.text_cache.get_batch([self.text_keys[i] for i in ids])
        cond.update((name, values) for name, values in image.items() if name != "latents")
        if not uses_mask:
            cond.pop(MASK_KEY, None)
        latents = image["latents"].to(device, non_blocking=True)
        conditioning = {k: v.to(device, non_blocking=True) for k, v in cond.items()}
        optimize_batch_for_gh200({"latents": latents, "conditioning": conditioning}, device)
        return Batch(latents, conditioning, samples, dropped, captions)

    def _from_cache(
        self,
        cache: TensorCache,
        keys: dict[str, str],
        samples: list[Sample],
        device: torch.device,
        draw: CaptionDraw = CaptionDraw(),
        uses_mask: bool = True,
    ) -> Batch:
        return self._prepared(cache.get_batch([keys[s.key] for s in samples]), samples, device, draw, uses_mask)

    def _draw(self, sampler: Any, samples: list[Sample]) -> CaptionDraw:
        """The caption decisions of the training micro-batch ``samples`` ``sampler`` has just yielded."""
        return self.caption_dropout.of_batch(sampler, samples) if self.caption_dropout is not None else CaptionDraw()

    def _uses_mask(self, sampler: Any, samples: list[Sample]) -> bool:
        """Whether the training micro-batch ``samples`` ``sampler`` has just yielded keeps its masks."""
        return self.masked_loss is None or self.masked_loss.uses_mask(sampler, samples)

    def _cached_latents(
        self, samples: list[Sample], device: torch.device, draw: CaptionDraw = CaptionDraw(), uses_mask: bool = True
    ) -> Batch:
        """``samples``' latents from the folder of their dataset (``cache_dir_vae``); a training batch
        holds one dataset, so one folder; samples of several are read folder by folder, order kept."""
        caches = [self.dataset_vae_caches.get(s.dataset_id, self.vae_cache) for s in samples]
        if all(c is caches[0] for c in caches):
            return self._from_cache(caches[0], self.latent_keys, samples, device, draw, uses_mask)
        entries = [c.get_batch([self.latent_keys[s.key]]) for c, s in zip(caches, samples)]
        stacked = {name: torch.cat([entry[name] for entry in entries]) for name in entries[0]}
        return self._prepared(stacked, samples, device, draw, uses_mask)

    def batch(self, samples: list[Sample], device: torch.device) -> Batch:
        """The micro-batch of ``samples`` outside the training order (evaluation, FLOP counting):
        cached latents, or, when latents are re-encoded while training, encoded now with one fixed
        augmentation version (``"eval"``), the same on every call."""
        if self._reencoder is None:
            return self._cached_latents(samples, device)
        return self._prepared(self._reencoder.encode(samples, ["eval"] * len(samples), device), samples, device)

    def iterate(self, sampler: Any, device: torch.device) -> Iterator[Batch]:
        """Micro-batches forever, epoch after epoch; the sampler keeps the position.

        ``refresh_each_epoch`` re-encodes the epoch's latents before its first batch is read;
        ``disable_cache`` encodes every batch as it is read, decoding ahead on the loader threads.
        """
        reencoder, epochs = self._reencoder, self.epoch_latents  # None / None in static mode
        while True:
            epoch = sampler.epoch + 1 if sampler.batch_index >= len(sampler) else sampler.epoch
            if self.mode == "disable_cache" and reencoder is not None:
                for samples, image in reencoder.iterate_epoch(sampler, epoch, device):
                    yield self._prepared(
                        image, samples, device, self._draw(sampler, samples), self._uses_mask(sampler, samples)
                    )
                continue
            if self.mode == "refresh_each_epoch" and epochs is not None:
                keys = epochs.prepare(sampler, epoch)
                cache = epochs.cache
                assert cache is not None, "prepare opens the epoch cache"
                for samples in sampler:
                    draw, uses_mask = self._draw(sampler, samples), self._uses_mask(sampler, samples)
                    yield self._from_cache(cache, keys, samples, device, draw, uses_mask)
                continue
            for samples in sampler:
                yield self._cached_latents(
                    samples, device, self._draw(sampler, samples), self._uses_mask(sampler, samples)
                )

    def close(self) -> None:
        """Stop the persistent decoding threads, if any."""
        if self._reencoder is not None:
            self._reencoder.threads.close()


def free_memory() -> None:
    """Collect garbage and return cached GPU memory (after the caller dropped its references)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
