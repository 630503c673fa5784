"""Keys for the VAE-latent cache.

A latent depends on the source image (its content, seen through size + mtime), how it
was bucketed, cropped and resized, which VAE encoded it, and in what dtype. Every one of
those is in the key, so changing any of them makes a miss rather than a stale latent. The one
blind spot of size + mtime, an edit in place that keeps both, is closed on request by the hash
of the file's bytes stored beside each latent (:func:`sample_source_hash`, ``verify_content``).
The cache itself is a :class:`~simpletuner.caching.tensor_cache.TensorCache`; see
:func:`~simpletuner.caching.opening.open_caches`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

from simpletuner.caching.fingerprint import fingerprint, source_hash
from simpletuner.caching.size_crop import SIZE_CROP_VERSION
from simpletuner.data_backend.masks import mask_file_bytes, mask_identity
from simpletuner.data_backend.pairs import source_identity
from simpletuner.data_backend.video import FRAME_FOLDER, sample_identity

if TYPE_CHECKING:
    from simpletuner.data_backend import Sample

logger = logging.getLogger(__name__)

LATENT_KIND = "vae-latent"


def latent_cache_key(
    *,
    sample_key: str,
    file_identity: str,
    bucket: tuple[int, int],
    crop: Mapping[str, Any],
    resolution: int,
    encoder_identity: str,
    dtype: str,
) -> str:
    """The cache key of one image's latent.

    ``sample_key`` is the sample's path or id in its dataset; ``file_identity`` changes when the file does
    (:func:`~simpletuner.caching.fingerprint.file_stat_identity` or a content hash); ``bucket`` the
    ``(width, height)`` it was resized to; ``crop`` every crop / augmentation decision (JSON-like);
    ``resolution`` the dataset's; ``encoder_identity`` the VAE's; ``dtype`` the latent's stored dtype.

    Raises:
        ValueError: ``bucket`` is not two positive ints.
        TypeError: a value cannot be fingerprinted.
    """
    if len(bucket) != 2 or not all(
        isinstance(side, int) and not isinstance(side, bool) and side > 0 for side in bucket
    ):
        raise ValueError(f"bucket must be (width, height) of positive ints, got {bucket!r}")
    return fingerprint(
        kind=LATENT_KIND,
        sample_key=sample_key,
        file_identity=file_identity,
        bucket=tuple(bucket),
        crop=dict(crop),
        resolution=resolution,
        encoder_identity=encoder_identity,
        dtype=str(dtype),
    )


#: Latents are encoded and stored in float32 (the training dtype is applied when read).
LATENT_DTYPE = "float32"


def sample_latent_key(
    dataset: Any,
    sample: Sample,
    encoder_identity: str,
    default_resolution: int,
    augment: Mapping[str, Any] | None = None,
    size_crop: bool = False,
) -> str:
    """The latent key of ``sample`` of a registered ``dataset`` (its backend gives the file
    identity; its config may override the resolution). The trainer and ``simpletuner cache``
    both reach it through :mod:`simpletuner.caching.keys`, so they always agree on what is cached.
    ``augment`` describes the augmentations the latent was encoded with
    (:func:`~simpletuner.data_backend.augment.augmentation_key`); None (off) leaves the key as
    it was before augmentations existed. ``size_crop``: the entry also holds the image's size and crop
    (:mod:`simpletuner.caching.size_crop`, SDXL); False leaves the key as it was before that existed."""
    crop: dict[str, Any] = {"style": sample.crop_style, "seed": sample.crop_seed}
    if sample.is_video:  # clips only, so image keys stay as they were
        crop.update(num_frames=sample.num_frames, frame_stride=sample.frame_stride)
    if sample.canvas is not None:  # downsampled before the crop (maximum_image_size)
        crop["canvas"] = list(sample.canvas)
    if sample.source is not None:  # an edit pair: the source's latents are cached with the image's
        crop["source"] = source_identity(sample)
    if sample.mask is not None:  # masked loss: the mask's latent-pixel weights are cached with the latents
        crop["mask"] = mask_identity(sample)
    if augment is not None:
        crop["augment"] = dict(augment)
    if size_crop:  # an entry without the values (an older version's) is then a miss
        crop["size_crop"] = SIZE_CROP_VERSION
    return latent_cache_key(
        sample_key=sample.key,
        file_identity=sample_identity(dataset.backend, sample),  # a frame folder: its frames' identities
        bucket=sample.bucket,
        crop=crop,
        resolution=dataset.config.resolution or default_resolution,
        encoder_identity=encoder_identity,
        dtype=LATENT_DTYPE,
    )


def sample_source_hash(backend: Any, sample: Sample) -> str:
    """:func:`~simpletuner.caching.fingerprint.source_hash` of the bytes ``sample`` is decoded
    from: its file (and an edit pair's source file, a masked sample's mask file), or for a frame folder the
    path and bytes of every frame it takes, in order.

    Raises:
        OSError: a file cannot be read (FileNotFoundError when it is gone).
    """
    parts: list[bytes] = []
    if sample.media != FRAME_FOLDER:
        parts.append(backend.read(sample.path))
        if sample.source is not None:  # an edit pair's latents hold its source's too
            with open(sample.source, "rb") as handle:
                parts.append(handle.read())
        if sample.mask is not None:  # and a masked sample's, its mask's weights
            parts.append(mask_file_bytes(sample))
        return source_hash(parts)
    for path in sample.frame_paths:
        parts += [path.encode("utf-8", "surrogateescape"), backend.read(path)]
    return source_hash(parts)


def sample_source_name(dataset: Any, sample: Sample) -> str:
    """How logs and ``cache verify --content`` name the source of ``sample``: its full path."""
    root = getattr(dataset.backend, "root", None)  # a backend without a folder: the sample's key
    return f"{root}/{sample.path}" if root is not None else sample.key
