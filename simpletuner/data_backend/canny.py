"""Canny edge maps, as SimpleTuner generates ControlNet conditioning images (``conditioning: {type: canny}``).

SimpleTuner's generator (helpers/data_generation/sample_generator.py:493-540 at bc8e6ab) converts each image to
grey and runs ``canny_py`` of the ``trainingsample`` package (thresholds ``low_threshold`` 50, ``high_threshold``
100), which is the Rust crate imageproc 0.25.1's ``edges::canny``, then stores the edges as an RGB image. This
module computes the same map with torch (``trainingsample`` ships x86-64 wheels only, and GH200 / GB10 are ARM):

- grey: ``floor((0.299 R + 0.587 G) + 0.114 B)`` in float32 (trainingsample's RGB->GRAY, measured);
- a Gaussian blur, sigma 1.4, 7 taps normalised in float32, horizontal then vertical, the border replicated, each
  pass truncated to uint8 (imageproc filter/mod.rs ``gaussian_blur_f32``, ``Clamp<f32> for u8``);
- 3x3 Sobel gradients on the blurred image (border replicated), magnitude ``hypot(gx, gy)``;
- non-maximum suppression inside a 1-pixel frame: the gradient angle in [0, 180) degrees picks the two neighbours
  (0: left/right, 45: down-right/up-left, 90: up/down, 135: down-left/up-right), a pixel below either is zeroed;
- hysteresis: from each pixel at or above ``high``, the edge grows to neighbours at or above ``low``; as in
  imageproc, only along six of the eight directions (right, down-right, down, up-left, left, down-left).

tests/test_canny.py checks it against ``trainingsample``'s output on fixed images, recorded as figures.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: SimpleTuner's defaults (sample_generator.py:498-499).
LOW_THRESHOLD = 50.0
HIGH_THRESHOLD = 100.0
#: imageproc's blur before the gradients (edges.rs, ``SIGMA``).
SIGMA = 1.4

_HORIZONTAL_SOBEL = ((-1, 0, 1), (-2, 0, 2), (-1, 0, 1))
_VERTICAL_SOBEL = ((-1, -2, -1), (0, 0, 0), (1, 2, 1))
#: (dy, dx) offsets hysteresis grows an edge along (imageproc edges.rs ``neighbor_indices``, as (x, y) there).
_GROWS_TO = ((0, 1), (1, 1), (1, 0), (-1, -1), (0, -1), (1, -1))
#: How many growth steps run between two checks whether hysteresis has settled.
_STEPS_PER_CHECK = 16


def grey(rgb: torch.Tensor) -> torch.Tensor:
    """``[H, W, 3]`` uint8 RGB -> ``[H, W]`` uint8 grey, as trainingsample's RGB->GRAY (float32, truncated)."""
    r, g, b = rgb.to(torch.float32).unbind(-1)
    return torch.floor((r * 0.299 + g * 0.587) + b * 0.114).to(torch.uint8)


def _gaussian_taps(sigma: float) -> list[float]:
    """imageproc's ``gaussian_kernel_f32``: radius ceil(2 sigma), values in float32, divided by their float32 sum."""
    radius = math.ceil(2.0 * sigma)
    s = torch.tensor(sigma, dtype=torch.float32)
    i = torch.arange(radius + 1, dtype=torch.float32)
    scale = torch.reciprocal(torch.sqrt(torch.tensor(2.0 * math.pi, dtype=torch.float32)) * s)
    half = scale * torch.exp(-(i**2) / (2.0 * s**2))
    taps = torch.cat([half.flip(0)[:-1], half])
    total = torch.zeros((), dtype=torch.float32)
    for tap in taps:  # summed in order, in float32
        total = total + tap
    return (taps / total).tolist()


def _shifted(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """Entry (y, x) holds image[y + dy, x + dx], indices clamped into the image (border replicated)."""
    h, w = image.shape
    rows = torch.arange(h).add(dy).clamp(0, h - 1)
    cols = torch.arange(w).add(dx).clamp(0, w - 1)
    return image[rows][:, cols]


def _blur(image: torch.Tensor, sigma: float) -> torch.Tensor:
    """``[H, W]`` uint8 -> uint8: the separable Gaussian, each pass accumulated in float32 tap by tap, truncated."""
    taps = _gaussian_taps(sigma)
    radius = len(taps) // 2
    out = image
    for axis in ("x", "y"):
        pixels = out.to(torch.float32)
        acc = torch.zeros_like(pixels)
        for i, tap in enumerate(taps):
            offset = i - radius
            neighbour = _shifted(pixels, 0, offset) if axis == "x" else _shifted(pixels, offset, 0)
            acc = acc + neighbour * torch.tensor(tap, dtype=torch.float32)
        out = acc.clamp(0, 255).to(torch.uint8)  # `as u8` truncates
    return out


def _correlate3x3(image: torch.Tensor, kernel: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """``[H, W]`` -> int32: the 3x3 kernel applied as a correlation, the border replicated."""
    pixels = image.to(torch.int32)
    out = torch.zeros_like(pixels)
    for ky, row in enumerate(kernel):
        for kx, weight in enumerate(row):
            if weight:
                out = out + weight * _shifted(pixels, ky - 1, kx - 1)
    return out


def _zero_outside(values: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """Entry (y, x) holds values[y + dy, x + dx], 0 outside the image."""
    h, w = values.shape
    padded = F.pad(values[None, None], (1, 1, 1, 1))[0, 0]
    return padded[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w]


def _thin(gx: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """Non-maximum suppression: the gradient magnitude where it is a maximum across the edge, else 0; the 1-pixel
    frame is 0."""
    g = torch.sqrt(gx.to(torch.float64) ** 2 + gy.to(torch.float64) ** 2).to(torch.float32)
    degrees_per_radian = torch.tensor(180.0, dtype=torch.float32) / torch.tensor(math.pi, dtype=torch.float32)
    angle = torch.atan2(gy.to(torch.float32), gx.to(torch.float32)) * degrees_per_radian
    angle = torch.where(angle < 0, angle + 180.0, angle)
    pairs = {
        0: ((0, -1), (0, 1)),
        45: ((1, 1), (-1, -1)),
        90: ((-1, 0), (1, 0)),
        135: ((1, -1), (-1, 1)),
    }
    bins = torch.full_like(angle, 0, dtype=torch.int64)
    bins = torch.where((angle >= 22.5) & (angle < 67.5), 45, bins)
    bins = torch.where((angle >= 67.5) & (angle < 112.5), 90, bins)
    bins = torch.where((angle >= 112.5) & (angle < 157.5), 135, bins)
    keep = torch.zeros_like(g, dtype=torch.bool)
    for degrees, (first, second) in pairs.items():
        local = (g >= _zero_outside(g, *first)) & (g >= _zero_outside(g, *second))
        keep |= (bins == degrees) & local
    frame = torch.zeros_like(keep)
    frame[1:-1, 1:-1] = True
    return torch.where(keep & frame, g, torch.zeros_like(g))


def _hysteresis(thinned: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Pixels reached from one at or above ``high`` through pixels at or above ``low``, along :data:`_GROWS_TO`."""
    allowed = thinned >= low
    edges = thinned >= high
    while True:
        before = edges
        for _ in range(_STEPS_PER_CHECK):
            grown = edges.clone()
            for dy, dx in _GROWS_TO:  # q is reached from p = q - (dy, dx)
                grown |= _zero_outside(edges.to(torch.uint8), -dy, -dx).bool()
            edges = grown & allowed | edges
        if torch.equal(edges, before):
            return edges


def canny(rgb: torch.Tensor, low_threshold: float = LOW_THRESHOLD, high_threshold: float = HIGH_THRESHOLD):
    """``[H, W, 3]`` uint8 RGB -> ``[H, W]`` uint8 edge map (255 on edges, 0 elsewhere), as SimpleTuner's
    generator computes it (module docstring).

    Raises:
        ValueError: not ``[H, W, 3]`` uint8, smaller than 3x3, or thresholds that are not ``0 < low <= high``.
    """
    if rgb.ndim != 3 or rgb.shape[-1] != 3 or rgb.dtype != torch.uint8:
        raise ValueError(f"canny takes [H, W, 3] uint8 RGB, got {tuple(rgb.shape)} {rgb.dtype}")
    if rgb.shape[0] < 3 or rgb.shape[1] < 3:
        raise ValueError(f"canny needs an image of at least 3x3 pixels, got {rgb.shape[1]}x{rgb.shape[0]}")
    if not 0 < low_threshold <= high_threshold:
        raise ValueError(
            f"canny thresholds must satisfy 0 < low_threshold <= high_threshold, got {low_threshold} and "
            f"{high_threshold}"
        )
    blurred = _blur(grey(rgb), SIGMA)
    thinned = _thin(_correlate3x3(blurred, _HORIZONTAL_SOBEL), _correlate3x3(blurred, _VERTICAL_SOBEL))
    return _hysteresis(thinned, low_threshold, high_threshold).to(torch.uint8) * 255


def canny_image(image, low_threshold: float = LOW_THRESHOLD, high_threshold: float = HIGH_THRESHOLD):
    """A PIL image -> its Canny edge map as an RGB PIL image (the edges in all three channels), as SimpleTuner
    stores a generated conditioning image."""
    import numpy as np
    from PIL import Image

    rgb = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy())
    edges = canny(rgb, low_threshold, high_threshold).numpy()
    return Image.fromarray(np.repeat(edges[:, :, None], 3, axis=2), mode="RGB")
