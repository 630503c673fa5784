"""Every cache key a config's training reads, from its model spec and datasets: the one rule.

The cache fill (:mod:`simpletuner.caching.fill`), the re-encoding modes (:mod:`simpletuner.caching.reencode`)
and ``simpletuner cache`` (:mod:`simpletuner.cli.cache`) all build their keys here, so ``cache clear
--stale-only`` keeps exactly what training reads: a latent per distinct sample (repeats share one;
:func:`static_latent_key`, with size and crop for SDXL), one per sample and epoch with
``refresh_each_epoch`` (:func:`epoch_latent_key`), and a text embedding per distinct caption line in the
run's precision, plus :data:`DROPPED_CAPTION` when ``caption_dropout_probability`` is above 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import torch

from simpletuner.caching.layout import TEXT_CACHE_NAME, VAE_CACHE_NAME
from simpletuner.caching.text_cache import caption_text_key
from simpletuner.caching.vae_cache import sample_latent_key
from simpletuner.data_backend.augment import augmentation_key, static_augmentation_key

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.data_backend import Sample

#: ``(registered dataset, sample)``: what a latent is encoded from.
Source = tuple[Any, Any]

#: The caption a sample trains with when caption dropout drops its own (``caption_dropout_probability``).
DROPPED_CAPTION = ""


@dataclass(frozen=True, order=True)
class PairedCaption:
    """The text-cache id of an edit pair's caption: its embedding depends on the sample's source image
    too (the edit model's text encoder sees both), so each pair has its own entry."""

    caption: str
    sample_key: str


#: A text-cache id: a caption, or an edit pair's :class:`PairedCaption`.
TextId = str | PairedCaption


def text_id(sample: Sample, caption: str | None = None, prompt_sees_source: bool = True) -> TextId:
    """The text-cache id ``sample`` trains with: its caption (or ``caption``, e.g. the dropped one), paired
    with the sample when it has a source image the prompt embedding sees (``prompt_sees_source``: the model's
    ``ModelSpec.prompt_sees_source``; Flux Kontext's prompt is the caption alone)."""
    caption = sample.caption if caption is None else caption
    return caption if sample.source is None or not prompt_sees_source else PairedCaption(caption, sample.key)


def _id_order(item) -> tuple:
    return (0, item, "") if isinstance(item, str) else (1, item.caption, item.sample_key)


def source_view(sample: Sample) -> dict[str, Any]:
    """What an edit pair's prompt embedding sees of its source: the file (:func:`source_identity`) and the
    geometry that cut it (bucket, crop, canvas)."""
    from simpletuner.data_backend.pairs import source_identity

    identity = source_identity(sample)
    assert identity is not None, "only an edit pair's sample has a source view"
    return {
        **identity,
        "bucket": list(sample.bucket),
        "crop": {"style": sample.crop_style, "seed": sample.crop_seed},
        "canvas": list(sample.canvas) if sample.canvas is not None else None,
    }


class EncoderIdentities(Protocol):
    """What the keys need of a model spec (:class:`simpletuner.models.ModelSpec` has it)."""

    @property
    def config(self) -> TrainingConfig: ...

    @property
    def conditions_on_size_crop(self) -> bool: ...

    @property
    def prompt_sees_source(self) -> bool: ...

    def image_encoder_identity(self) -> str: ...

    def text_encoder_identity(self) -> str: ...


def static_version(config) -> int | None:
    """The augmentation version of the latents in the shared ``vae`` cache: 0 when ``config`` caches
    augmented latents there (``static`` mode), None when they are not augmented."""
    return None if static_augmentation_key(config) is None else 0


def static_latent_key(config, image_identity: str, dataset, sample, size_crop: bool = False) -> str:
    """The key of ``sample``'s latent in the shared ``vae`` cache (augmented with :func:`static_version`);
    ``size_crop``: the entry holds the image's size and crop too
    (``ModelSpec.conditions_on_size_crop``)."""
    augment = static_augmentation_key(config)
    return sample_latent_key(dataset, sample, image_identity, config.resolution, augment=augment, size_crop=size_crop)


def epoch_latent_key(config, image_identity: str, dataset, sample, version: int, size_crop: bool = False) -> str:
    """The key of ``sample``'s latent re-encoded for ``refresh_each_epoch`` with augmentation ``version``
    (the epoch); ``size_crop`` as for :func:`static_latent_key`."""
    augment = augmentation_key(config.augmentations, config.seed, version)
    return sample_latent_key(dataset, sample, image_identity, config.resolution, augment=augment, size_crop=size_crop)


@dataclass(frozen=True)
class CacheKeys:
    """The keys of one config's caches.

    Attributes:
        latents: sample key -> its latent's key in the ``vae`` cache, each sample once (empty when none asked).
        texts: text id (:func:`text_id`) -> its embeddings' key in the ``text`` cache, captions sorted.
        sources: sample key -> ``(dataset, sample)`` of each distinct sample (the first repeat).
        static_version: the augmentation version of the ``vae`` cache's latents (:func:`static_version`).
        has_dropped_caption: :data:`DROPPED_CAPTION` is in :attr:`texts` for caption dropout.
        prompt_sees_source: an edit pair's text id pairs its caption with the sample (:func:`text_id`).
    """

    latents: dict[str, str]
    texts: dict[TextId, str]
    sources: dict[str, Source]
    static_version: int | None
    has_dropped_caption: bool = False
    prompt_sees_source: bool = True

    def needed(self) -> dict[str, set[str]]:
        """``{"vae": latent keys, "text": text keys}``: every entry these keys name, by cache."""
        return {VAE_CACHE_NAME: set(self.latents.values()), TEXT_CACHE_NAME: set(self.texts.values())}

    def latent_sources(self) -> dict[str, Source]:
        """Latent key -> ``(dataset, sample)`` it is encoded from."""
        return {key: self.sources[sample_key] for sample_key, key in self.latents.items()}

    def texts_of(self, datasets: Iterable[Any]) -> dict[TextId, str]:
        """:attr:`texts` of the captions ``datasets`` still hold (after dropping undecodable images)."""
        kept = _text_ids(datasets, self.has_dropped_caption, self.prompt_sees_source)
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
        image_identity, size_crop = spec.image_encoder_identity(), spec.conditions_on_size_crop
        latent_keys = {
            key: static_latent_key(config, image_identity, ds, s, size_crop) for key, (ds, s) in sources.items()
        }
    text_identity = spec.text_encoder_identity()
    has_dropped = config.caption_dropout_probability > 0
    sees_source = spec.prompt_sees_source
    texts: dict[TextId, str] = {}
    for item in sorted(_text_ids(datasets, has_dropped, sees_source), key=_id_order):
        if isinstance(item, str):
            texts[item] = caption_text_key(item, text_identity, text_dtype)
        else:
            view = source_view(sources[item.sample_key][1])
            texts[item] = caption_text_key(item.caption, text_identity, text_dtype, image=view)
    return CacheKeys(latent_keys, texts, sources, static_version(config), has_dropped, sees_source)


def _text_ids(datasets: Iterable[Any], has_dropped: bool, sees_source: bool = True) -> set[TextId]:
    """The text ids the samples of ``datasets`` train with (and the dropped caption's, with dropout);
    ``sees_source`` as :func:`text_id`'s ``prompt_sees_source``."""
    ids: set[TextId] = set()
    paired_only = True
    for ds in datasets:
        for sample in ds.samples:
            ids.add(text_id(sample, None, sees_source))
            for line in sample.caption_lines[1:]:  # a caption file's other lines: one draw each
                ids.add(text_id(sample, line, sees_source))
            paired_only = paired_only and isinstance(text_id(sample, None, sees_source), PairedCaption)
            if has_dropped:
                ids.add(text_id(sample, DROPPED_CAPTION, sees_source))
    if has_dropped and not (ids and paired_only):
        ids.add(DROPPED_CAPTION)  # the empty caption alone (an edit model embeds no caption without its source)
    return ids
