"""The dataset size rules the metadata scan applies to each image (``minimum_image_size``, the aspect
ratio limits, ``allow_upscale``), and the warnings and errors they give."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from simpletuner.data_backend.bad_files import is_too_many
from simpletuner.data_backend.buckets import MAX_UPSCALE_FACTOR, bucket_name, upscale_factor
from simpletuner.data_backend.geometry import Geometry

if TYPE_CHECKING:
    from simpletuner.configuration.dataset_sections import FolderDatasetConfig

logger = logging.getLogger("simpletuner.data_backend.metadata")  # the scan's messages, under the scan's name


class SizeRules:
    """The dataset's size rules, applied to each image as it is scanned (before any caching).

    ``minimum_image_size`` (in the unit of ``resolution_type``; unset: pixels of the shorter side) skips
    smaller images, ``minimum_aspect_ratio`` / ``maximum_aspect_ratio`` images of another shape
    (:class:`~simpletuner.data_backend.geometry.Geometry`); ``allow_upscale:
    false`` skips images smaller than their bucket (any upscale); unset, images needing more
    than :data:`MAX_UPSCALE_FACTOR` to cover their bucket stop the run (:meth:`report`), naming
    how many and by how much, when they are ``max_bad_image_fraction`` of the dataset or more
    (a wrong ``resolution``, not a few odd files: those are named in a warning); ``true`` trains
    on them upscaled, with a warning. Skips are counted and reported in one warning per rule.
    """

    def __init__(self, dataset_cfg: FolderDatasetConfig, resolution: float, tolerance: float, geometry: Geometry):
        self.tolerance = tolerance
        self.geometry = geometry
        self.allow_upscale = dataset_cfg.allow_upscale
        self.resolution = resolution
        rules = ("minimum_image_size", "minimum_aspect_ratio", "maximum_aspect_ratio", "allow_upscale")
        self.skipped: dict[str, list[tuple[str, int, int]]] = {rule: [] for rule in rules}
        self.far: list[tuple[float, str, int, int, tuple[int, int]]] = []  # (factor, path, w, h, bucket)

    def keep(self, path: str, width: int, height: int, bucket: tuple[int, int]) -> bool:
        rule = "minimum_image_size" if self.geometry.is_below_minimum(width, height) else None
        rule = rule or self.geometry.aspect_rule(width, height)
        if rule is not None:
            self.skipped[rule].append((path, width, height))
            return False
        factor = upscale_factor(width, height, bucket)
        if self.allow_upscale is False and factor > 1:
            self.skipped["allow_upscale"].append((path, width, height))
            return False
        if factor > MAX_UPSCALE_FACTOR:
            self.far.append((factor, path, width, height, bucket))
        return True

    @property
    def num_skipped(self) -> dict[str, int]:
        return {rule: len(found) for rule, found in self.skipped.items() if found}

    def report(self, dataset_id: str, root: str, total: int, noun: str, has_kept: bool) -> None:
        """Warn about skipped images; stop on far upscales (``allow_upscale`` unset) or when the
        rules left nothing to train on."""
        geometry = self.geometry
        shown = {
            "minimum_image_size": geometry.describe_minimum(),
            "minimum_aspect_ratio": f"with an aspect ratio (width / height) below minimum_aspect_ratio "
            f"{geometry.minimum_aspect_ratio}",
            "maximum_aspect_ratio": f"with an aspect ratio (width / height) above maximum_aspect_ratio "
            f"{geometry.maximum_aspect_ratio}",
            "allow_upscale": "smaller than their bucket (allow_upscale: false)",
        }
        lines, fixes = [], []
        for rule, found in self.skipped.items():
            if not found:
                continue
            examples = ", ".join(f"{p} ({w}x{h})" for p, w, h in found[:3])
            lines.append(f"{len(found)} of {total} {noun} {shown[rule]}, e.g. {examples}")
            if rule == "minimum_image_size":
                path, width, height = max(found, key=lambda f: geometry.minimum_that_keeps(f[1], f[2]))
                lines[-1] += f"; the largest is {path} ({geometry.describe_size(width, height)})"
                keeps = geometry.minimum_that_keeps(width, height)
                fixes.append(f"lower `minimum_image_size` to at most {keeps:g} (keeps the largest) or remove it")
            elif rule == "allow_upscale":
                fixes.append("set `allow_upscale` to true (or leave it unset), or lower `resolution`")
            else:
                aspects = sorted(w / h for _, w, h in found)
                change = "lower" if rule == "minimum_aspect_ratio" else "raise"
                fixes.append(
                    f"{change} `{rule}` or remove it (the skipped images' aspect ratios, width / height, run from "
                    f"{aspects[0]:.3g} to {aspects[-1]:.3g})"
                )
        if lines and not has_kept:
            raise ValueError(
                f"dataset {dataset_id!r}: every image under {root} was skipped by its size rules: "
                + "; ".join(lines)
                + ". To train on them: "
                + "; ".join(fixes)
            )
        for line in lines:
            logger.warning("dataset %r: skipped %s", dataset_id, line)
        if not self.far:
            return
        self.far.sort(reverse=True)
        factor, path, width, height, bucket = self.far[0]
        median_side = sorted(min(w, h) for _, _, w, h, _ in self.far)[len(self.far) // 2]
        what = (
            f"{len(self.far)} of {total} {noun} would be upscaled more than {MAX_UPSCALE_FACTOR:g}x to cover "
            f"their buckets at resolution {self.resolution} (up to {factor:.1f}x: {path} is {width}x{height}, "
            f"its bucket {bucket_name(bucket)}; their median shorter side is {median_side} px)"
        )
        if self.allow_upscale or not is_too_many(len(self.far), total, self.tolerance):
            why = (
                "allow_upscale: true"
                if self.allow_upscale
                else f"less than max_bad_image_fraction {self.tolerance:g} of the dataset; set `allow_upscale` or "
                "`minimum_image_size` to decide"
            )
            logger.warning("dataset %r: %s; training on them upscaled (%s)", dataset_id, what, why)
            return
        raise ValueError(
            f"dataset {dataset_id!r}: {what}, at least max_bad_image_fraction {self.tolerance:g} of the dataset, "
            "which trains the model on blur. Lower `resolution` (to about "
            f"{median_side}), set the dataset's `minimum_image_size` to skip small images, `allow_upscale: false` to "
            "skip every image smaller than its bucket, or `allow_upscale: true` to train on them upscaled anyway"
        )
