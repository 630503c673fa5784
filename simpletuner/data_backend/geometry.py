"""Dataset geometry: which bucket an image trains at, how large it is before the crop, and which
images a dataset's size and aspect rules leave out.

Per dataset entry, **native** buckets (``crop`` and ``resolution_type`` unset:
:func:`~simpletuner.data_backend.buckets.bucket_for`) or **SimpleTuner's** formulas (either set), so a
dataset brought from SimpleTuner trains at the sizes it trained at there; then the image is resized to
cover its bucket (after a downsample to :attr:`CropPlan.canvas` when it exceeds ``maximum_image_size``)
and cropped at ``crop_style``. The formulas: documentation/DATA_SOURCES.md, "Buckets".
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from simpletuner.data_backend.buckets import bucket_for

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.configuration.dataset_sections import FolderDatasetConfig

RESOLUTION_TYPES = ("pixel", "area", "pixel_area")
CROP_ASPECTS = ("square", "preserve", "closest", "random")

#: SimpleTuner's defaults: what ``resolution_type`` / ``crop`` / ``crop_aspect`` mean when a dataset
#: uses its geometry (``crop`` or ``resolution_type`` set) and leaves the others out.
DEFAULT_RESOLUTION_TYPE = "pixel_area"
DEFAULT_CROP_ASPECT = "square"

#: Decimals an image's aspect ratio is rounded to before its bucket is computed (SimpleTuner's
#: ``aspect_bucket_rounding`` default).
ASPECT_DECIMALS = 2

#: Areas (megapixels) SimpleTuner maps to a square side, within ``SQUARE_SNAP_TOLERANCE``.
SQUARE_SNAP = {0.25: 512, 0.5: 768, 1.0: 1024, 2.0: 1536, 4.0: 2048}
SQUARE_SNAP_TOLERANCE = 0.05

#: Megapixel values above this are refused with ``resolution_type: area`` (the value looks like pixels).
MAX_MEGAPIXELS = 64.0


def round_to_alignment(value: float, alignment: int) -> int:
    """``value`` rounded to the nearest multiple of ``alignment`` (Python ``round``: a half goes to
    the even multiple), never below ``alignment``."""
    return max(int(round(value / alignment)) * alignment, alignment)


def rounded_aspect(width: float, height: float) -> float:
    """``width / height`` rounded to :data:`ASPECT_DECIMALS` decimals."""
    return round(width / height, ASPECT_DECIMALS)


@dataclass(frozen=True)
class CropPlan:
    """Where one image trains: its ``bucket`` ``(width, height)`` and the ``canvas`` it is resized to
    before the crop, or None to resize it just enough to cover the bucket."""

    bucket: tuple[int, int]
    canvas: tuple[int, int] | None = None


@dataclass(frozen=True)
class Geometry:
    """The bucket and size rules of one dataset, resolved from its entry (:func:`geometry_for`).

    ``resolution`` is a side in pixels, or megapixels with ``resolution_type == "area"``; the size
    limits are in the same unit (``pixel_area``: sides in pixels whose squares are areas).
    ``resolution_type`` None with ``crop`` None is the native way (see the module docstring).
    """

    resolution: float
    alignment: int
    resolution_type: str | None = None
    crop: bool | None = None
    crop_aspect: str = DEFAULT_CROP_ASPECT
    aspect_buckets: tuple[tuple[float, float | None], ...] = ()  # (aspect, weight or None)
    minimum_image_size: float | None = None
    maximum_image_size: float | None = None
    target_downsample_size: float | None = None
    minimum_aspect_ratio: float | None = None
    maximum_aspect_ratio: float | None = None

    @property
    def is_native(self) -> bool:
        """Whether buckets come from :func:`~simpletuner.data_backend.buckets.bucket_for` (today's way)."""
        return self.resolution_type is None and self.crop is None

    @property
    def unit(self) -> str:
        """``pixel`` (native too), ``area`` or ``pixel_area``: the unit of the resolution and size limits."""
        return self.resolution_type or "pixel"

    @property
    def is_square_crop(self) -> bool:
        return self.crop is True and self.crop_aspect == "square"

    @property
    def megapixels(self) -> float:
        """The bucket area in megapixels (``area``, ``pixel_area``)."""
        return self.resolution if self.unit == "area" else self.resolution**2 / 1e6

    def square_side(self) -> int:
        """The side of a square bucket."""
        if self.unit == "pixel":
            return int(self.resolution)
        area = self.megapixels * 1e6
        for snap, side in SQUARE_SNAP.items():
            if abs(self.megapixels - snap) < SQUARE_SNAP_TOLERANCE:
                area = side**2
                break
        return round_to_alignment(math.sqrt(area), self.alignment)

    def plan(self, width: int, height: int, crop_seed: int) -> CropPlan:
        """The :class:`CropPlan` of an image of ``width`` x ``height`` pixels (as displayed).

        ``crop_seed`` draws the aspect of ``crop_aspect: random`` (the same seed, the same bucket).
        """
        if width <= 0 or height <= 0:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        if self.is_native:
            return CropPlan(bucket_for(width, height, int(self.resolution), self.alignment))
        bucket = self._bucket(width, height, crop_seed)
        return CropPlan(bucket, self._canvas(width, height, bucket))

    def _bucket(self, width: int, height: int, crop_seed: int) -> tuple[int, int]:
        if self.is_square_crop:
            side = self.square_side()
            return side, side
        aspect = rounded_aspect(width, height)
        if self.crop is True and self.crop_aspect in ("closest", "random"):
            aspect = self.choose_aspect(aspect, crop_seed)
        if self.unit == "pixel":
            bucket = self._pixel_bucket(aspect, width < height)
        else:
            bucket = self._area_bucket(aspect)
        if rounded_aspect(*bucket) == 1.0:
            side = self.square_side()
            return side, side
        return bucket

    def _pixel_bucket(self, aspect: float, is_portrait: bool) -> tuple[int, int]:
        resolution = int(self.resolution)
        if is_portrait:  # the image's width is the side that becomes ``resolution``
            width, height = resolution, int(resolution / aspect)
        else:
            width, height = int(resolution * aspect), resolution
        return round_to_alignment(width, self.alignment), round_to_alignment(height, self.alignment)

    def _area_bucket(self, aspect: float) -> tuple[int, int]:
        edge = round_to_alignment(int(math.sqrt(self.megapixels * 1e6)), self.alignment)
        return (
            round_to_alignment(edge * math.sqrt(aspect), self.alignment),
            round_to_alignment(edge / math.sqrt(aspect), self.alignment),
        )

    def choose_aspect(self, aspect: float, crop_seed: int) -> float:
        """The aspect ``crop_aspect`` ``closest`` / ``random`` takes from ``crop_aspect_buckets`` for an
        image of (rounded) ``aspect``: the nearest (the first listed on a tie), or one drawn from
        ``crop_seed`` (by weight when the buckets give weights, else uniformly)."""
        aspects = [a for a, _ in self.aspect_buckets]
        if self.crop_aspect == "closest":
            return min(aspects, key=lambda a: abs(a - aspect))
        digest = hashlib.sha256(f"crop_aspect\x00{crop_seed}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        weights = [w for _, w in self.aspect_buckets if w is not None]
        if len(weights) == len(aspects):
            return rng.choices(aspects, weights)[0]
        return rng.choice(aspects)

    def is_too_large(self, width: int, height: int) -> bool:
        """Whether ``maximum_image_size`` asks to downsample this image before its crop."""
        limit = self.maximum_image_size
        if limit is None or self.crop is not True or self.target_downsample_size is None:
            return False
        if self.unit == "pixel":
            return width > limit or height > limit
        return width * height > self._area_pixels(limit)

    def _area_pixels(self, value: float) -> float:
        """A size limit of this dataset as an area in pixels (``area``: megapixels, ``pixel_area``: a side)."""
        return value * 1e6 if self.unit == "area" else value**2

    def _canvas(self, width: int, height: int, bucket: tuple[int, int]) -> tuple[int, int] | None:
        target = self.target_downsample_size
        if target is None or not self.is_too_large(width, height):
            return None
        if self.unit == "pixel":
            scale = target / min(width, height)
        else:
            scale = math.sqrt(self._area_pixels(target) / (width * height))
        canvas = (round(width * scale), round(height * scale))
        if canvas[0] < bucket[0] or canvas[1] < bucket[1]:
            return None  # the downsampled image would not cover the bucket: resize to cover it instead
        return canvas

    # --- size and aspect rules ------------------------------------------------------------------

    def is_below_minimum(self, width: int, height: int) -> bool:
        """Whether ``minimum_image_size`` leaves this image out (``pixel`` and native: its shorter
        side; ``area`` / ``pixel_area``: its area, and with a square crop its shorter side too)."""
        minimum = self.minimum_image_size
        if minimum is None:
            return False
        if self.unit == "pixel":
            return min(width, height) < minimum
        area = self._area_pixels(minimum)
        if self.is_square_crop and min(width, height) < math.floor(math.sqrt(area)):
            return True
        return width * height < area

    def minimum_that_keeps(self, width: int, height: int) -> float:
        """The largest ``minimum_image_size`` (in its unit) that keeps an image of ``width`` x ``height``."""
        side = min(width, height)
        if self.unit == "pixel":
            return side
        area = min(width * height, side * side) if self.is_square_crop else width * height
        if self.unit == "area":
            return math.floor(area / 1e6 * 1e4) / 1e4  # rounded down, so that value keeps the image
        return math.isqrt(area)

    def aspect_rule(self, width: int, height: int) -> str | None:
        """``minimum_aspect_ratio`` / ``maximum_aspect_ratio`` when it leaves this image out (its
        ``width / height`` is outside the range), else None."""
        aspect = width / height
        if self.minimum_aspect_ratio is not None and aspect < self.minimum_aspect_ratio:
            return "minimum_aspect_ratio"
        if self.maximum_aspect_ratio is not None and aspect > self.maximum_aspect_ratio:
            return "maximum_aspect_ratio"
        return None

    def size_measure(self, width: int, height: int) -> float:
        """What ``minimum_image_size`` compares, for ordering images: the shorter side (``pixel``) or the area."""
        return min(width, height) if self.unit == "pixel" else width * height

    def describe_size(self, width: int, height: int) -> str:
        """An image's size in the unit of ``minimum_image_size``, for messages."""
        if self.unit == "pixel":
            return f"{width}x{height}, shorter side {min(width, height)} px"
        if self.unit == "area":
            return f"{width}x{height}, {width * height / 1e6:.3g} megapixels"
        return f"{width}x{height}, area {width * height} px (a {math.sqrt(width * height):.0f}² square)"

    def describe_minimum(self) -> str:
        """What ``minimum_image_size`` requires, for messages ("" when it is unset)."""
        minimum = self.minimum_image_size
        if minimum is None:
            return ""
        if self.unit == "pixel":
            return f"with a shorter side below minimum_image_size {_number(minimum)} px"
        if self.unit == "area":
            text = f"with an area below minimum_image_size {_number(minimum)} megapixels ({minimum * 1e6:.0f} px)"
        else:
            text = (
                f"with an area below minimum_image_size {_number(minimum)}² px ({minimum**2:.0f} px, "
                "resolution_type pixel_area)"
            )
        if self.is_square_crop:
            text += f" or a shorter side below {math.floor(math.sqrt(self._area_pixels(minimum)))} px (square crop)"
        return text


def _number(value: float) -> str:
    return f"{value:g}"


def geometry_for(dataset_cfg: FolderDatasetConfig, config: TrainingConfig) -> Geometry:
    """The :class:`Geometry` of a dataset entry: its own ``resolution`` or the config's, the config's
    ``aspect_bucket_alignment``, and the entry's crop, unit and size keys (absent ones: unset)."""
    crop = dataset_cfg.crop
    resolution_type: str | None = dataset_cfg.resolution_type
    if resolution_type is None and crop is not None:
        resolution_type = DEFAULT_RESOLUTION_TYPE
    buckets: list[tuple[float, float | None]] = []
    for bucket in dataset_cfg.crop_aspect_buckets or ():
        if isinstance(bucket, (int, float)):
            buckets.append((float(bucket), None))
        else:
            buckets.append((float(bucket.aspect), float(bucket.weight)))
    return Geometry(
        resolution=dataset_cfg.resolution or config.resolution,
        alignment=config.aspect_bucket_alignment,
        resolution_type=resolution_type,
        crop=crop,
        crop_aspect=dataset_cfg.crop_aspect or DEFAULT_CROP_ASPECT,
        aspect_buckets=tuple(buckets),
        minimum_image_size=dataset_cfg.minimum_image_size,
        maximum_image_size=dataset_cfg.maximum_image_size,
        target_downsample_size=dataset_cfg.target_downsample_size,
        minimum_aspect_ratio=dataset_cfg.minimum_aspect_ratio,
        maximum_aspect_ratio=dataset_cfg.maximum_aspect_ratio,
    )
