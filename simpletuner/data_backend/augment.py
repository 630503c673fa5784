"""Image and video augmentations applied to decoded pixels before the VAE encodes them.

Input and output: a float tensor in ``[-1, 1]``, ``[3, H, W]`` (an image) or ``[3, F, H, W]`` (a clip: every
frame gets the same flip, crop window and colour factors). Every draw comes from ``random.Random`` seeded
with a stable hash of ``(config seed, sample key, version)``, so a cached latent stays valid and a resumed
run encodes what an uninterrupted one would; the version is ``0`` for the ``static`` cache, the epoch for
``refresh_each_epoch``, the read position for ``disable_cache``. torch / numpy only (no torchvision).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.configuration.sections import Augmentations

#: Bump when the augmentation arithmetic changes: it is part of every augmented cache key.
AUGMENT_ALGORITHM_VERSION = 1

#: ITU-R 601 luma weights (what PIL's ``convert("L")`` uses) for contrast and saturation.
_LUMA = (0.299, 0.587, 0.114)


@dataclass(frozen=True)
class AugmentParams:
    """What one augmentation does: drawn once per (seed, sample, version), size-independent.

    ``crop_x`` / ``crop_y`` are fractions in ``[0, 1]`` of the room the enlarged image leaves
    (0: the window at the left/top edge, 0.5: centred); factors of 1.0 change nothing.
    """

    flip: bool = False
    crop_scale: float = 1.0  # the image is enlarged by this before the window is cut
    crop_x: float = 0.5
    crop_y: float = 0.5
    brightness: float = 1.0
    contrast: float = 1.0
    saturation: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able description of what is applied (for logs and tests)."""
        return asdict(self)


def augment_seed(seed: int, sample_key: str, version: int | str) -> int:
    """A 64-bit seed from ``(seed, sample_key, version)``, stable across processes and Python runs
    (``hash()`` of a str is salted per process, so it is not used)."""
    digest = hashlib.sha256(f"augment\x00{seed}\x00{sample_key}\x00{version}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def draw_params(augmentations: Augmentations, seed: int, sample_key: str, version: int | str) -> AugmentParams:
    """The augmentation of ``sample_key`` at ``version`` under ``augmentations`` (the config's
    :class:`~simpletuner.configuration.schema.Augmentations`). Disabled parts stay identity."""
    rng = random.Random(augment_seed(seed, sample_key, version))
    # Always draw every number in the same order, so enabling one part does not move another's draws.
    flip_draw, x, y = rng.random(), rng.random(), rng.random()
    color = [rng.uniform(-1.0, 1.0) for _ in range(3)]
    jitter, spread = float(augmentations.crop_jitter), float(augmentations.color_jitter)
    return AugmentParams(
        flip=flip_draw < augmentations.flip_probability,
        crop_scale=1.0 + 2.0 * jitter,
        crop_x=x if jitter else 0.5,
        crop_y=y if jitter else 0.5,
        brightness=1.0 + spread * color[0],
        contrast=1.0 + spread * color[1],
        saturation=1.0 + spread * color[2],
    )


def _check_pixels(pixels: torch.Tensor) -> None:
    if pixels.dim() not in (3, 4) or pixels.shape[0] != 3:
        raise ValueError(f"augmentations take pixels shaped [3, H, W] or [3, F, H, W], got {tuple(pixels.shape)}")


def crop_window(height: int, width: int, params: AugmentParams) -> tuple[int, int, int, int]:
    """``(scaled_h, scaled_w, top, left)``: the enlarged size and where the ``height x width``
    window is cut from it. The window always lies inside the enlarged image."""
    scaled_h = max(height, round(height * params.crop_scale))
    scaled_w = max(width, round(width * params.crop_scale))
    top = min(scaled_h - height, int(params.crop_y * (scaled_h - height + 1)))
    left = min(scaled_w - width, int(params.crop_x * (scaled_w - width + 1)))
    return scaled_h, scaled_w, top, left


def jitter_crop(pixels: torch.Tensor, params: AugmentParams) -> torch.Tensor:
    """Enlarge by ``params.crop_scale`` (bilinear, so values stay in range) and cut the original
    size back out at the drawn offset; the same window for every frame of a clip."""
    if params.crop_scale == 1.0:
        return pixels
    height, width = pixels.shape[-2:]
    scaled_h, scaled_w, top, left = crop_window(height, width, params)
    frames = pixels.unsqueeze(0) if pixels.dim() == 3 else pixels.transpose(0, 1)  # [N, 3, H, W]
    scaled = F.interpolate(frames, size=(scaled_h, scaled_w), mode="bilinear", align_corners=False)
    window = scaled[..., top : top + height, left : left + width]
    out = window[0] if pixels.dim() == 3 else window.transpose(0, 1)
    return out.contiguous()


def _luma(x01: torch.Tensor) -> torch.Tensor:
    """Per-pixel luma of ``[3, ...]`` pixels in [0, 1], shaped ``[1, ...]``."""
    r, g, b = x01[0], x01[1], x01[2]
    return (_LUMA[0] * r + _LUMA[1] * g + _LUMA[2] * b).unsqueeze(0)


def adjust_color(pixels: torch.Tensor, brightness: float, contrast: float, saturation: float) -> torch.Tensor:
    """Brightness (scale), contrast (towards the clip's mean luma) and saturation (towards each
    pixel's luma), in that order, in [0, 1] space like torchvision's ``ColorJitter``; clamped
    back into [-1, 1]. A factor of exactly 1 is skipped, so ``(1, 1, 1)`` returns the input."""
    if brightness == contrast == saturation == 1.0:
        return pixels
    x = (pixels + 1.0) * 0.5
    if brightness != 1.0:
        x = (x * brightness).clamp_(0.0, 1.0)
    if contrast != 1.0:
        mean = _luma(x).mean()
        x = ((x - mean) * contrast + mean).clamp_(0.0, 1.0)
    if saturation != 1.0:
        grey = _luma(x)
        x = ((x - grey) * saturation + grey).clamp_(0.0, 1.0)
    return x * 2.0 - 1.0


def apply_params(pixels: torch.Tensor, params: AugmentParams) -> torch.Tensor:
    """Apply ``params`` to one image ``[3, H, W]`` or clip ``[3, F, H, W]`` in [-1, 1]."""
    _check_pixels(pixels)
    out = jitter_crop(pixels, params)
    if params.flip:
        out = torch.flip(out, dims=[-1])
    out = adjust_color(out, params.brightness, params.contrast, params.saturation)
    return out.clamp(-1.0, 1.0) if out is not pixels else out


def augment_pixels(
    pixels: torch.Tensor, augmentations: Augmentations, seed: int, sample_key: str, version: int | str
) -> torch.Tensor:
    """The augmented ``pixels`` of ``sample_key`` at ``version`` (see the module docstring);
    the input itself when ``augmentations`` is disabled.

    Raises:
        ValueError: ``pixels`` is not ``[3, H, W]`` or ``[3, F, H, W]``.
    """
    _check_pixels(pixels)
    if not augmentations.is_enabled:
        return pixels
    return apply_params(pixels, draw_params(augmentations, seed, sample_key, version))


def augmentation_key(augmentations: Augmentations, seed: int, version: int | str) -> dict[str, Any] | None:
    """A JSON-able description of the augmentations an entry was encoded with, for its cache
    key: the settings, the seed, the version and the algorithm. None when augmentations are
    disabled, so keys of un-augmented latents stay what they were."""
    if not augmentations.is_enabled:
        return None
    return {
        "algorithm": AUGMENT_ALGORITHM_VERSION,
        "flip_probability": float(augmentations.flip_probability),
        "crop_jitter": float(augmentations.crop_jitter),
        "color_jitter": float(augmentations.color_jitter),
        "seed": int(seed),
        "version": version,
    }


def static_augmentation_key(config: TrainingConfig) -> dict[str, Any] | None:
    """The ``augment`` part of latent keys the ``static`` cache of ``config`` holds, or None when it
    holds un-augmented latents (augmentations off, or a mode that does not keep augmented latents in
    the shared cache)."""
    if config.augmentations_cache_mode != "static":
        return None
    return augmentation_key(config.augmentations, config.seed, 0)
