"""Every cache key a config's training reads, from its model spec and datasets: the one rule.

Training (:func:`simpletuner.training.batches.prepare_caches`), the re-encoding modes
(:mod:`simpletuner.caching.reencode`) and ``simpletuner cache`` (:mod:`simpletuner.caching.admin`)
all build their keys here, so what ``cache clear --stale-only`` keeps is exactly what training reads:

- a latent of the ``vae`` cache per distinct sample (a dataset's repeats share one), encoded with the
  ``static`` augmentation version when augmentations are on (:func:`static_latent_key`);
- ``refresh_each_epoch``: a latent per sample and epoch in the epoch folders (:func:`epoch_latent_key`);
- a text embedding per distinct caption, in the run's precision (:class:`CacheKeys`.texts), and of the
  empty caption :data:`DROPPED_CAPTION` when ``caption_dropout_probability`` is above 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import torch

from simpletuner.caching.layout import TEXT_CACHE_NAME, VAE_CACHE_NAME
from simpletuner.caching.text_cache import caption_text_key
from simpletuner.caching.vae_cache import sample_latent_key
from simpletuner.data_backend.augment import augmentation_key, static_augmentation_key

#: ``(registered dataset, sample)``: what a latent is encoded from.
Source = tuple[Any, Any]

#: The caption a sample trains with when caption dropout drops its own (``caption_dropout_probability``).
DROPPED_CAPTION = ""


class EncoderIdentities(Protocol):
    """What the keys need of a model spec (:class:`simpletuner.models.ModelSpec` has it)."""

    config: Any

    def image_encoder_identity(self) -> str: ...

    def text_encoder_identity(self) -> str: ...


def static_version(config) -> int | None:
    """The augmentation version of the latents in the shared ``vae`` cache: 0 when ``config`` caches
    augmented latents there (``static`` mode), None when they are not augmented."""
    return None if static_augmentation_key(config) is None else 0


def static_latent_key(config, image_identity: str, dataset, sample) -> str:
    """The key of ``sample``'s latent in the shared ``vae`` cache (augmented with :func:`static_version`)."""
    augment = static_augmentation_key(config)
    return sample_latent_key(dataset, sample, image_identity, config.resolution, augment=augment)


def epoch_latent_key(config, image_identity: str, dataset, sample, version: int) -> str:
    """The key of ``sample``'s latent re-encoded for ``refresh_each_epoch`` with augmentation ``version``
    (the epoch)."""
    augment = augmentation_key(config.augmentations, config.seed, version)
    return sample_latent_key(dataset, sample, image_identity, config.resolution, augment=augment)


@dataclass(frozen=True)
class CacheKeys:
    """The keys of one config's caches.

    Attributes:
        latents: sample key -> key of its latent in the ``vae`` cache, datasets in order, each sample
            once (empty when asked for none: the re-encoding modes read no cached latents).
        texts: caption -> key of its embeddings in the ``text`` cache, captions sorted.
        sources: sample key -> ``(dataset, sample)`` of each distinct sample (the first repeat).
        static_version: the augmentation version the ``vae`` cache's latents are encoded with
            (:func:`static_version`).
        has_dropped_caption: :data:`DROPPED_CAPTION` is in :attr:`texts` for caption dropout (kept by
            :meth:`texts_of` whatever the datasets hold).
    """

    latents: dict[str, str]
    texts: dict[str, str]
    sources: dict[str, Source]
    static_version: int | None
    has_dropped_caption: bool = False

    def needed(self) -> dict[str, set[str]]:
        """``{"vae": latent keys, "text": text keys}``: every entry these keys name, by cache."""
        return {VAE_CACHE_NAME: set(self.latents.values()), TEXT_CACHE_NAME: set(self.texts.values())}

    def latent_sources(self) -> dict[str, Source]:
        """Latent key -> ``(dataset, sample)`` it is encoded from."""
        return {key: self.sources[sample_key] for sample_key, key in self.latents.items()}

    def texts_of(self, datasets: Iterable[Any]) -> dict[str, str]:
        """:attr:`texts` of the captions ``datasets`` still hold (after dropping undecodable images)."""
        kept = {sample.caption for ds in datasets for sample in ds.samples}
        if self.has_dropped_caption:
            kept.add(DROPPED_CAPTION)
        return {caption: key for caption, key in self.texts.items() if caption in kept}


def cache_keys(
    spec: EncoderIdentities, datasets: Iterable[Any], text_dtype: torch.dtype, latents: bool = True
) -> CacheKeys:
    """The keys of every latent and text embedding training on ``datasets`` (registered datasets) with
    ``spec`` reads from the shared caches; embeddings in ``text_dtype`` (the run's precision).

    ``latents=False`` leaves :attr:`CacheKeys.latents` empty: the re-encoding cache modes read no cached
    latent (``simpletuner cache`` still counts those a ``static`` run would read).
    """
    datasets = list(datasets)
    config = spec.config
    sources: dict[str, Source] = {}
    for ds in datasets:
        for sample in ds.samples:
            sources.setdefault(sample.key, (ds, sample))  # repeats share one cache entry
    latent_keys: dict[str, str] = {}
    if latents:
        image_identity = spec.image_encoder_identity()
        latent_keys = {key: static_latent_key(config, image_identity, ds, s) for key, (ds, s) in sources.items()}
    text_identity = spec.text_encoder_identity()
    captions = {sample.caption for ds in datasets for sample in ds.samples}
    has_dropped = getattr(config, "caption_dropout_probability", 0) > 0
    if has_dropped:
        captions.add(DROPPED_CAPTION)
    texts = {caption: caption_text_key(caption, text_identity, text_dtype) for caption in sorted(captions)}
    return CacheKeys(latent_keys, texts, sources, static_version(config), has_dropped)
