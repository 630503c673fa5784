"""Timestep sampling and loss weighting, shared by every family.

The same distributions (``uniform``, ``logit_normal``, ``mode``) draw ``u`` in (0, 1), the noise level, for
DDPM families (scaled to a timestep index) and flow matching ones (then shifted); ``logit_mean`` has the sign
of diffusers' scripts. DDPM families may also shift their noise per sample and channel (:func:`offset_noise`).
All draws come from the caller's CPU generator, so a resumed run draws the same values.
See documentation/MODEL_FAMILIES.md, "Timesteps and loss types" and "logit_mean".
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
        if logit_mean and "logit_mean" not in _warned:  # said once: the sign changed (2026-11) to diffusers'
            _warned.add("logit_mean")
            logger.info(
                "logit_mean %s: noise levels are drawn as sigmoid(N(%s, %s)), so %s: diffusers' scripts' sign (the "
                "SD3 paper's m and releases before 2026-11 used the opposite one)",
                logit_mean,
                -logit_mean,
                logit_std,
                "more low-noise steps" if logit_mean > 0 else "more high-noise steps",
            )
        return torch.sigmoid(torch.randn(batch_size, generator=generator) * logit_std - logit_mean)
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
    if prediction_type == "v_prediction":
        return clipped / (snr + 1)
    # A zero-terminal-SNR schedule (rescale_betas_zero_snr) has snr 0 at its last step: the weight's limit there is 1.
    return torch.where(snr > 0, clipped / snr.clamp(min=torch.finfo(snr.dtype).tiny), torch.ones_like(snr))


def flow_weights(sigmas: torch.Tensor, kind: str) -> torch.Tensor:
    """Flow-matching per-sample weights: ``sigma_sqrt`` (1 / sigma^2, clamped), ``cosmap`` or
    ``sigma_squared`` (sigma^2: an l2 velocity loss so weighted is the loss diffusers' SD3 script takes
    with ``--precondition_outputs 1``, ``pred * (-sigma) + noisy`` against the clean latents)."""
    if kind == "sigma_sqrt":
        return (sigmas.float() ** -2.0).clamp(max=1e4)
    if kind == "sigma_squared":
        return sigmas.float() ** 2
    if kind == "cosmap":
        bot = 1 - 2 * sigmas + 2 * sigmas**2
        return 2 / (math.pi * bot)
    raise ValueError(f"loss_weighting {kind!r} is not a flow-matching weighting (sigma_sqrt, cosmap, sigma_squared)")


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
