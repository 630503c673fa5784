"""Timestep sampling and loss weighting, shared by every family.

Two schedule kinds exist: DDPM-style (integer timesteps, ``alphas_cumprod``; sd, sdxl) and flow
matching (a noise level ``sigma`` in (0, 1); sd3, flux, wan). The sampling distributions are the
same for both — ``uniform``, ``logit_normal`` (``sigmoid(N(logit_mean, logit_std))``, more weight
mid-schedule) and ``mode`` (SD3's mode sampling with ``mode_scale``) — drawn as ``u`` in (0, 1);
flow matching then applies the resolution ``shift``, DDPM scales ``u`` to a timestep index.
DDPM families may also shift their noise per sample and channel (:func:`offset_noise`).
All draws come from the caller's CPU generator, so a resumed run draws the same values.
"""

from __future__ import annotations

import logging
import math

import torch
from torch._subclasses.fake_tensor import is_fake

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def sample_u(
    batch_size: int,
    generator: torch.Generator,
    method: str = "uniform",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
) -> torch.Tensor:
    """``batch_size`` values in (0, 1) drawn by ``method`` (float32, CPU)."""
    if method == "uniform":
        return torch.rand(batch_size, generator=generator)
    if method == "logit_normal":
        return torch.sigmoid(torch.randn(batch_size, generator=generator) * logit_std + logit_mean)
    if method == "mode":
        u = torch.rand(batch_size, generator=generator)
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    raise ValueError(f"timestep_sampling {method!r} is not one of uniform, logit_normal, mode")


def ddpm_timesteps(u: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
    """Integer timesteps in [0, T) from ``u`` in (0, 1)."""
    return (u * num_train_timesteps).long().clamp_(0, num_train_timesteps - 1)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Flow-matching resolution shift: ``shift * s / (1 + (shift - 1) * s)`` (1.0: unchanged)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def min_snr_weights(timesteps: torch.Tensor, scheduler, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma per-sample weights for a DDPM schedule: ``min(snr, gamma) / snr`` for epsilon
    targets, ``min(snr, gamma) / (snr + 1)`` for v-prediction. Identity (said once) when the
    scheduler has no ``alphas_cumprod``."""
    alphas = getattr(scheduler, "alphas_cumprod", None)
    if alphas is None:
        if "min_snr" not in _warned:
            _warned.add("min_snr")
            logger.warning(
                "loss_weighting min_snr needs a scheduler with alphas_cumprod (%s has none): using no weighting",
                type(scheduler).__name__,
            )
        return torch.ones(timesteps.shape, dtype=torch.float32)
    a = alphas.to(torch.float32)[timesteps.cpu()]
    snr = a / (1 - a)
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr


def flow_weights(sigmas: torch.Tensor, kind: str) -> torch.Tensor:
    """Flow-matching per-sample weights: ``sigma_sqrt`` (1 / sigma^2, clamped) or ``cosmap``."""
    if kind == "sigma_sqrt":
        return (sigmas.float() ** -2.0).clamp(max=1e4)
    if kind == "cosmap":
        bot = 1 - 2 * sigmas + 2 * sigmas**2
        return 2 / (math.pi * bot)
    raise ValueError(f"loss_weighting {kind!r} is not a flow-matching weighting (sigma_sqrt, cosmap)")


def offset_noise(noise: torch.Tensor, generator: torch.Generator, offset: float, probability: float) -> torch.Tensor:
    """``noise`` plus ``offset`` times one normal draw per sample and channel, constant over the
    other dimensions (``randn(B, C, 1, 1)``): the offset-noise trick that lets a DDPM model learn
    very dark or very light images. Applied to the whole batch with ``probability`` (one uniform
    draw from ``generator`` decides, none when it is 1); ``offset`` 0: ``noise`` unchanged, nothing drawn.
    Draw order: the gate, then the offsets (float32, CPU)."""
    if offset == 0:
        return noise
    if probability < 1:
        gate = torch.rand(1, generator=generator)
        # The memory estimator's fake step holds no values: it takes the offset (shapes only).
        if not is_fake(gate) and not gate.item() < probability:
            return noise
    shape = (*noise.shape[:2], *([1] * (noise.ndim - 2)))
    shift = torch.randn(shape, generator=generator, dtype=torch.float32)
    return noise + (offset * shift).to(noise.device, noise.dtype)
