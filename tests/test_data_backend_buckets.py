"""bucket_for: alignment, area, aspect, clamping, symmetry."""

from __future__ import annotations

import math

import pytest

from simpletuner.data_backend import MAX_ASPECT_RATIO, bucket_for

SIZES = [
    (512, 512),
    (768, 512),
    (512, 768),
    (1920, 1080),
    (1080, 1920),
    (3000, 2000),
    (640, 480),
    (1000, 999),
    (333, 1000),
]
SETTINGS = [(512, 64), (1024, 64), (64, 16), (256, 8), (768, 32)]


@pytest.mark.parametrize("resolution,alignment", SETTINGS)
@pytest.mark.parametrize("size", SIZES)
def test_bucket_sides_aligned_and_area_near_resolution(size, resolution, alignment):
    bw, bh = bucket_for(*size, resolution, alignment)
    assert bw % alignment == 0 and bh % alignment == 0
    assert bw >= alignment and bh >= alignment
    assert abs(bw * bh / resolution**2 - 1) <= 0.15


@pytest.mark.parametrize("resolution,alignment", SETTINGS)
def test_square_image_gets_square_bucket(resolution, alignment):
    assert bucket_for(700, 700, resolution, alignment) == (resolution, resolution)
    assert bucket_for(1, 1, resolution, alignment) == (resolution, resolution)


@pytest.mark.parametrize("resolution,alignment", SETTINGS)
def test_orientation_is_kept_and_symmetric(resolution, alignment):
    bw, bh = bucket_for(1500, 1000, resolution, alignment)
    assert bw > bh
    assert bucket_for(1000, 1500, resolution, alignment) == (bh, bw)


def test_aspect_is_the_closest_available():
    bw, bh = bucket_for(1920, 1080, 1024, 64)
    assert abs(math.log((bw / bh) / (1920 / 1080))) < 0.05
    bw, bh = bucket_for(768, 512, 256, 8)
    assert (bw, bh) == (312, 208)  # exactly 3:2 is reachable at 8-pixel alignment


@pytest.mark.parametrize("size", [(4000, 100), (100, 4000), (10000, 10)])
def test_extreme_aspect_is_clamped_to_four_to_one(size):
    bw, bh = bucket_for(*size, 512, 64)
    assert max(bw, bh) / min(bw, bh) == MAX_ASPECT_RATIO == 4.0
    assert (bw > bh) == (size[0] > size[1])
    assert bucket_for(*size, 512, 64) == bucket_for(size[0] * 2, size[1] * 2, 512, 64)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="positive"):
        bucket_for(0, 10, 512, 64)
    with pytest.raises(ValueError, match="positive"):
        bucket_for(10, 10, 512, 0)
