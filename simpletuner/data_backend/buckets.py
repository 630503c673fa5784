"""Aspect buckets: the training size (width, height) an image of a given shape is cropped to.

Every image is resized to cover its bucket and cropped to it, so a batch drawn from one
bucket stacks into one tensor. Buckets keep the area near ``resolution**2`` (so memory per
sample is about constant) and the aspect ratio near the image's own.
"""

from __future__ import annotations

import math

#: Most elongated aspect ratio a bucket takes (long side / short side). Images more
#: elongated than this (panoramas, strips) are put in the 4:1 bucket and cropped: a
#: 16:1 bucket at 512² area would be 2048x128, too thin for the UNet's down-sampling.
MAX_ASPECT_RATIO = 4.0

#: Candidates whose area is further than this from resolution² are used only if no
#: candidate is closer.
AREA_TOLERANCE = 0.15


def _multiples_around(value: float, alignment: int) -> list[int]:
    """The multiples of ``alignment`` just below and above ``value`` (never below ``alignment``)."""
    low = max(1, math.floor(value / alignment)) * alignment
    high = max(1, math.ceil(value / alignment)) * alignment
    return sorted({low, high})


def bucket_for(width: int, height: int, resolution: int, alignment: int) -> tuple[int, int]:
    """The bucket ``(bucket_w, bucket_h)`` for an image of ``width`` x ``height`` pixels.

    Both sides are multiples of ``alignment`` (at least ``alignment``), the area about ``resolution**2``
    (within ``AREA_TOLERANCE`` where the alignment allows), the aspect the closest such a size gets to the
    image's, clamped to ``MAX_ASPECT_RATIO`` (4:1). A square image gets ``(resolution, resolution)`` when
    ``resolution`` is a multiple of ``alignment``; ``bucket_for(h, w, ...)`` is ``bucket_for(w, h, ...)`` reversed.

    Raises:
        ValueError: a non-positive size, resolution or alignment.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if resolution <= 0 or alignment <= 0:
        raise ValueError(f"resolution ({resolution}) and alignment ({alignment}) must be positive")
    if height > width:
        bucket_h, bucket_w = _landscape_bucket(height / width, resolution, alignment)
        return bucket_w, bucket_h
    return _landscape_bucket(width / height, resolution, alignment)


def _landscape_bucket(aspect: float, resolution: int, alignment: int) -> tuple[int, int]:
    """Bucket for ``aspect`` = long / short >= 1, returned as (long, short)."""
    aspect = min(aspect, MAX_ASPECT_RATIO)
    area = float(resolution) ** 2
    ideal_w = math.sqrt(area * aspect)
    candidates = []
    for bucket_w in _multiples_around(ideal_w, alignment):
        for bucket_h in _multiples_around(area / bucket_w, alignment):
            if bucket_h > bucket_w:
                continue  # keep landscape images landscape (or square)
            aspect_error = abs(math.log((bucket_w / bucket_h) / aspect))
            area_error = abs(bucket_w * bucket_h / area - 1.0)
            candidates.append((area_error > AREA_TOLERANCE, aspect_error, area_error, bucket_w, bucket_h))
    # Never empty: the upper width multiple is >= sqrt(area) >= the lower height multiple
    # (or both are ``alignment``), so that pair always passes the landscape check.
    _, _, _, bucket_w, bucket_h = min(candidates)
    return bucket_w, bucket_h


#: Images scaled up by more than this (linear factor) to cover their bucket stop the run when they
#: are ``max_bad_image_fraction`` of a dataset or more (fewer: a warning), unless the dataset says
#: what to do with them (``allow_upscale``, ``minimum_image_size``): a 96 px image trained at
#: 4096 px teaches the model blur, and costs the memory of a 4096 px latent.
MAX_UPSCALE_FACTOR = 2.0


def upscale_factor(width: int, height: int, bucket: tuple[int, int]) -> float:
    """How much an image of ``width`` x ``height`` is scaled to cover ``bucket`` (resize then crop):
    above 1 it is upscaled, at or below 1 it is only downscaled and cropped."""
    return max(bucket[0] / width, bucket[1] / height)


def bucket_name(bucket: tuple[int, int]) -> str:
    """``(768, 512)`` -> ``"768x512"`` for logs and messages."""
    return f"{bucket[0]}x{bucket[1]}"
