"""Canny edge maps as SimpleTuner generates ControlNet conditioning (``conditioning: {type: canny}``): equal to
``trainingsample.canny_py`` (imageproc 0.25.1's ``edges::canny``) on fixed images.

The expected figures were computed with trainingsample 0.3.2 (the package SimpleTuner's CannyEdgeSampleGenerator
calls, helpers/data_generation/sample_generator.py:510-520 at bc8e6ab): ``cvt_color_py(image, 7)`` then
``canny_py(grey, low, high)``, on the images :func:`_images` makes; each edge map is recorded as its edge count and
the first 16 hex digits of the SHA-256 of ``numpy.packbits(edges > 0)``.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

from simpletuner.data_backend.canny import canny, canny_image, grey

#: (image, low, high) -> (edge pixels, digest), from trainingsample 0.3.2.
TRAININGSAMPLE = {
    ("noise", 50, 100): (84, "a3d68437391e5512"),
    ("noise", 20, 60): (485, "33ff6516824c5f35"),
    ("noise", 75.5, 75.5): (96, "56c92cd5a7ca9636"),
    ("shapes", 50, 100): (685, "eccc7f8aac5794d8"),
    ("shapes", 20, 60): (694, "1c17c3fa0db41dae"),
    ("shapes", 75.5, 75.5): (691, "d69946d70e80b546"),
    ("grainy", 50, 100): (576, "394860fe401a3bd6"),
    ("grainy", 20, 60): (586, "2f0115edbb253436"),
    ("grainy", 75.5, 75.5): (581, "9aec20bc31ccdb9c"),
}
#: Grey levels v whose grey image of (v, v, v) trainingsample's RGB->GRAY gives as v - 1 (float32, truncated).
GREY_ONE_BELOW = [37, 61, 74, 93, 111, 122, 148, 186, 215, 222, 233, 244, 253]


def _images() -> dict[str, np.ndarray]:
    """name -> [H, W, 3] uint8, made with numpy alone (PCG64 streams are stable across numpy versions)."""
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    y, x = np.mgrid[0:80, 0:96]
    shapes = np.zeros((80, 96, 3), dtype=np.uint8)
    shapes[:] = (30, 60, 90)
    shapes[(x - 35) ** 2 + (y - 29) ** 2 <= 22**2] = (220, 180, 40)
    shapes[(x >= 50) & (x <= 90) & (y >= 30) & (y <= 75)] = (10, 200, 120)
    shapes[np.abs(x * 80 + y * 96 - 80 * 96) <= 150] = (255, 255, 255)
    grainy = np.clip(shapes.astype(np.int16) + rng.integers(-40, 41, shapes.shape), 0, 255).astype(np.uint8)
    return {"noise": noise, "shapes": shapes, "grainy": grainy}


@pytest.mark.parametrize("name, low, high", list(TRAININGSAMPLE))
def test_edges_equal_simpletuners_generator(name, low, high):
    edges = canny(torch.from_numpy(_images()[name]), low, high).numpy()
    assert set(np.unique(edges)) <= {0, 255}
    digest = hashlib.sha256(np.packbits(edges > 0).tobytes()).hexdigest()[:16]
    assert (int((edges > 0).sum()), digest) == TRAININGSAMPLE[(name, low, high)]


def test_grey_is_trainingsamples():
    levels = torch.arange(256, dtype=torch.uint8)
    got = grey(levels[:, None, None].expand(256, 1, 3)).flatten()
    assert [v for v in range(256) if got[v] != v] == GREY_ONE_BELOW
    assert all(got[v] == v - 1 for v in GREY_ONE_BELOW)


def test_the_stored_image_has_the_edges_in_every_channel():
    rgb = _images()["shapes"]
    image = canny_image(Image.fromarray(rgb))
    array = np.asarray(image)
    assert image.mode == "RGB" and image.size == (96, 80)
    assert (array[..., 0] == array[..., 1]).all() and (array[..., 0] == array[..., 2]).all()
    assert (array[..., 0] == canny(torch.from_numpy(rgb)).numpy()).all()


@pytest.mark.parametrize(
    "shape, low, high, words",
    [
        ((10, 10, 4), 50, 100, "[H, W, 3] uint8"),
        ((2, 10, 3), 50, 100, "at least 3x3"),
        ((10, 10, 3), 100, 50, "0 < low_threshold <= high_threshold"),
        ((10, 10, 3), 0, 50, "0 < low_threshold <= high_threshold"),
    ],
)
def test_what_it_cannot_compute_is_refused(shape, low, high, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        canny(torch.zeros(shape, dtype=torch.uint8), low, high)
