"""Timestep sampling and loss weighting (simpletuner.models.noise) and their use in training."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from simpletuner.models import noise


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("method", ["uniform", "logit_normal", "mode"])
def test_draws_are_in_range_and_reproducible(method):
    a = noise.sample_u(4096, _gen(), method)
    assert a.min() > 0 and a.max() < 1 and a.dtype == torch.float32
    assert torch.equal(a, noise.sample_u(4096, _gen(), method))


def test_logit_normal_concentrates_mid_schedule_and_follows_its_mean():
    u = noise.sample_u(20000, _gen(), "uniform")
    ln = noise.sample_u(20000, _gen(), "logit_normal")
    middle = lambda x: ((x > 0.25) & (x < 0.75)).float().mean().item()  # noqa: E731
    assert middle(ln) > middle(u) + 0.1  # sigmoid(N(0,1)) puts ~68% in (0.25, 0.75) vs 50%
    shifted = noise.sample_u(20000, _gen(), "logit_normal", logit_mean=1.0)  # diffusers' sign: positive, less noise
    assert shifted.median().item() == pytest.approx(1 / (1 + math.e), abs=0.01)  # sigmoid(-1)


def test_mode_sampling_formula():
    u = torch.rand(5, generator=_gen(3))
    want = 1 - u - 1.29 * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    assert torch.allclose(noise.sample_u(5, _gen(3), "mode"), want)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="not one of uniform, logit_normal, mode"):
        noise.sample_u(2, _gen(), "beta")


def test_ddpm_timesteps_cover_the_range_and_stay_in_bounds():
    t = noise.ddpm_timesteps(torch.tensor([0.0, 0.4999, 0.9999, 1.0]), 1000)
    assert t.tolist() == [0, 499, 999, 999] and t.dtype == torch.long


def test_shift():
    s = torch.tensor([0.0, 0.5, 1.0])
    assert torch.allclose(noise.shift_sigmas(s, 3.0), torch.tensor([0.0, 0.75, 1.0]))
    assert torch.equal(noise.shift_sigmas(s, 1.0), s)


def test_min_snr_weights_by_hand():
    from diffusers import DDPMScheduler

    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    t = torch.tensor([10, 500, 990])
    a = sched.alphas_cumprod[t]
    snr = a / (1 - a)
    eps = noise.min_snr_weights(t, sched, 5.0, "epsilon")
    assert torch.allclose(eps, torch.minimum(snr, torch.tensor(5.0)) / snr)
    assert eps[0] < 1 and eps[2] == pytest.approx(1.0)  # low noise (high SNR) is down-weighted, high noise kept
    v = noise.min_snr_weights(t, sched, 5.0, "v_prediction")
    assert torch.allclose(v, torch.minimum(snr, torch.tensor(5.0)) / (snr + 1))


def test_min_snr_without_alphas_is_identity_with_one_warning(caplog):
    from diffusers import FlowMatchEulerDiscreteScheduler

    noise._warned.discard("min_snr")
    caplog.set_level(logging.WARNING)
    sched = FlowMatchEulerDiscreteScheduler()
    for _ in range(3):
        w = noise.min_snr_weights(torch.tensor([1, 2]), sched, 5.0, "epsilon")
        assert torch.equal(w, torch.ones(2))
    assert sum("min_snr needs a scheduler with alphas_cumprod" in r.getMessage() for r in caplog.records) == 1


def test_flow_weights():
    s = torch.tensor([0.5, 0.1])
    assert torch.allclose(noise.flow_weights(s, "sigma_sqrt"), torch.tensor([4.0, 100.0]))
    assert torch.allclose(noise.flow_weights(torch.tensor([0.5]), "cosmap"), torch.tensor([2 / (math.pi * 0.5)]))
    with pytest.raises(ValueError):
        noise.flow_weights(s, "min_snr")


def test_training_with_logit_normal_and_min_snr(make_config, tmp_path):
    from simpletuner.configuration import validate_config
    from simpletuner.state import StateTracker
    from simpletuner.training.trainer import Trainer

    def run(name, **extra):
        raw = make_config(max_train_steps=3, output_dir=str(tmp_path / name), **extra)
        return Trainer(StateTracker(validate_config(raw), raw)).train()

    plain = run("plain")
    weighted = run("weighted", timestep_sampling="logit_normal", loss_weighting="min_snr", snr_gamma=1.0)
    assert len(weighted.losses) == 3 and all(math.isfinite(v) for v in weighted.losses)
    assert weighted.losses != plain.losses
    assert run("plain_again").losses == plain.losses  # uniform draws unchanged by the new options
