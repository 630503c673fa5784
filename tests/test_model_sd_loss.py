"""The sd family's loss, recomputed by hand from the DDPM formulas: epsilon and v-prediction targets,
uniform and logit-normal timesteps, min-SNR weights. Each case fails if the spec used another
target or weighting (v-prediction with the epsilon target, min-SNR with the other divisor)."""

from __future__ import annotations

import pytest
import torch

from simpletuner.configuration import validate_config
from simpletuner.models import get_model_spec

CASES = [
    ("epsilon", "uniform", "none"),
    ("v_prediction", "uniform", "none"),
    ("epsilon", "logit_normal", "none"),
    ("epsilon", "uniform", "min_snr"),
    ("v_prediction", "logit_normal", "min_snr"),
]


def _by_hand(spec, unet, latents, embeds, seed: int, prediction_type: str, sampling: str, weighting: str):
    """The per-sample loss and the epsilon-target loss of the same draws, from the formulas:
    ``noisy = sqrt(a) x + sqrt(1 - a) e``, v = ``sqrt(a) e - sqrt(1 - a) x``, ``snr = a / (1 - a)``."""
    cfg, steps = spec.config, spec.load_noise_scheduler().config.num_train_timesteps
    g = torch.Generator().manual_seed(seed)  # the spec's draw order: the noise, then the timesteps
    noise = torch.randn(latents.shape, generator=g)
    if sampling == "uniform":
        timesteps = torch.randint(0, steps, (latents.shape[0],), generator=g)
    else:
        u = torch.sigmoid(torch.randn(latents.shape[0], generator=g) * cfg.logit_std - cfg.logit_mean)
        timesteps = (u * steps).long().clamp(0, steps - 1)
    a = spec.load_noise_scheduler().alphas_cumprod.double()[timesteps].view(-1, 1, 1, 1)
    x, e = latents.double(), noise.double()
    noisy = a.sqrt() * x + (1 - a).sqrt() * e
    target = e if prediction_type == "epsilon" else a.sqrt() * e - (1 - a).sqrt() * x
    pred = unet(noisy.float(), timesteps, embeds, return_dict=False)[0].double()
    loss = ((pred - target) ** 2).mean(dim=(1, 2, 3))
    eps_loss = ((pred - e) ** 2).mean(dim=(1, 2, 3))
    if weighting == "min_snr":
        snr = (a / (1 - a)).flatten()
        weights = snr.clamp(max=cfg.snr_gamma) / (snr + 1 if prediction_type == "v_prediction" else snr)
        loss, eps_loss = loss * weights, eps_loss * weights
    return loss, eps_loss


@pytest.mark.parametrize("prediction_type,sampling,weighting", CASES)
def test_sd_loss_by_hand(make_config, prediction_type, sampling, weighting):
    cfg = validate_config(
        make_config(
            prediction_type=prediction_type,
            timestep_sampling=sampling,
            logit_mean=0.3,
            loss_weighting=weighting,
            snr_gamma=2.0,
        )
    )
    spec = get_model_spec(cfg)
    unet = spec.load_denoiser().eval()
    latent_shape, cond_shapes = spec.batch_shapes(3)
    gen = torch.Generator().manual_seed(7)
    latents = torch.randn(latent_shape, generator=gen)
    embeds = torch.randn(cond_shapes["prompt_embeds"], generator=gen)
    with torch.no_grad():
        got = spec.training_loss(unet, latents, {"prompt_embeds": embeds}, torch.Generator().manual_seed(3))
        want, eps_loss = _by_hand(spec, unet, latents, embeds, 3, prediction_type, sampling, weighting)
    assert got.shape == (3,) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-6, rtol=1e-5), (got, want)
    if prediction_type == "v_prediction":  # the epsilon target would give another loss
        assert not torch.allclose(got.double(), eps_loss, rtol=1e-2), (got, eps_loss)
    if weighting == "min_snr":  # the weights are in (0, 1]: not all 1 at these draws
        unweighted, _ = _by_hand(spec, unet, latents, embeds, 3, prediction_type, sampling, "none")
        assert not torch.allclose(want, unweighted, rtol=1e-2)
