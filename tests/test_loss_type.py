"""``loss_type`` (l2, huber, smooth_l1) with its ``huber_schedule``, and ``noise_offset``: values
checked against hand computations (math on known numbers, the DDPM / flow formulas redone here),
the default l2 loss bit for bit equal to the mean squared error the families used before."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from simpletuner.configuration import validate_config
from simpletuner.models import get_model_spec, losses

# --- the element-wise curves on known numbers --------------------------------------------------


def _pseudo_huber(d: float, c: float) -> float:
    return math.sqrt(d * d + c * c) - c


def test_huber_and_smooth_l1_per_sample_by_hand():
    target = torch.zeros(2, 1, 2, 2)
    pred = torch.tensor([[3.0, -1.0, 0.5, 0.0], [0.01, 10.0, -2.0, 4.0]]).view(2, 1, 2, 2)
    c = 0.5
    rows = [[3.0, -1.0, 0.5, 0.0], [0.01, 10.0, -2.0, 4.0]]
    huber = [sum(2 * c * _pseudo_huber(d, c) for d in row) / 4 for row in rows]
    smooth = [sum(2 * _pseudo_huber(d, c) for d in row) / 4 for row in rows]
    l2 = [sum(d * d for d in row) / 4 for row in rows]
    got_huber = losses.per_sample_loss(pred, target, "huber", c)
    got_smooth = losses.per_sample_loss(pred, target, "smooth_l1", c)
    assert got_huber.shape == (2,) and got_huber.dtype == torch.float32
    assert torch.allclose(got_huber.double(), torch.tensor(huber, dtype=torch.float64), rtol=1e-6)
    assert torch.allclose(got_smooth.double(), torch.tensor(smooth, dtype=torch.float64), rtol=1e-6)
    assert torch.allclose(losses.per_sample_loss(pred, target, "l2").double(), torch.tensor(l2, dtype=torch.float64))
    # A threshold per sample: each row uses its own c.
    per_c = torch.tensor([0.5, 2.0])
    want = [sum(2 * cc * _pseudo_huber(d, cc) for d in row) / 4 for row, cc in zip(rows, (0.5, 2.0))]
    got = losses.per_sample_loss(pred, target, "huber", per_c)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6)


def test_the_curves_are_quadratic_near_zero_and_linear_far_out():
    c, small, large = 0.1, torch.full((1, 4), 1e-3), torch.full((1, 4), 100.0)
    zero = torch.zeros(1, 4)
    # huber ~ d^2 near 0, ~ 2 c |d| far out; smooth_l1 ~ d^2 / c near 0, ~ 2 |d| far out.
    assert losses.per_sample_loss(small, zero, "huber", c).item() == pytest.approx(1e-6, rel=1e-3)
    assert losses.per_sample_loss(large, zero, "huber", c).item() == pytest.approx(2 * c * 100, rel=1e-2)
    assert losses.per_sample_loss(small, zero, "smooth_l1", c).item() == pytest.approx(1e-6 / c, rel=1e-3)
    assert losses.per_sample_loss(large, zero, "smooth_l1", c).item() == pytest.approx(200, rel=1e-2)


# --- the threshold schedules ---------------------------------------------------------------------


class _Scheduler:
    """Just what the DDPM schedule reads: ``alphas_cumprod`` and ``config.num_train_timesteps``."""

    def __init__(self, alphas: list[float]):
        self.alphas_cumprod = torch.tensor(alphas, dtype=torch.float64)
        self.config = type("Config", (), {"num_train_timesteps": 1000})()


def test_ddpm_schedules_by_hand():
    scheduler = _Scheduler([0.99, 0.5, 0.01])
    t = torch.tensor([0, 1, 2])
    assert losses.ddpm_huber_c(t, scheduler, "constant", 0.2) == 0.2
    exp = losses.ddpm_huber_c(torch.tensor([0, 500, 1000]), scheduler, "exponential", 0.2)
    assert torch.allclose(exp.double(), torch.tensor([1.0, math.sqrt(0.2), 0.2], dtype=torch.float64), rtol=1e-6)
    snr = losses.ddpm_huber_c(t, scheduler, "snr", 0.2)
    want = []
    for a in (0.99, 0.5, 0.01):
        s = math.sqrt((1 - a) / a)
        want.append((1 - 0.2) / (1 + s) ** 2 + 0.2)
    assert torch.allclose(snr.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6)
    assert snr[0] > snr[1] > snr[2] > 0.2  # clean steps: near 1, noisy ones: towards huber_c


def test_flow_schedules_by_hand():
    sigmas = torch.tensor([0.0, 0.25, 1.0])
    assert losses.flow_huber_c(sigmas, "constant", 0.3) == 0.3
    exp = losses.flow_huber_c(sigmas, "exponential", 0.3)  # SimpleTuner's exp(-a t), t = 1000 sigma, T = 1000
    assert torch.allclose(exp.double(), torch.tensor([1.0, 0.3**0.25, 0.3], dtype=torch.float64), rtol=1e-6)
    snr = losses.flow_huber_c(sigmas, "snr", 0.3)
    want = [(1 - 0.3) / (1 + math.sqrt((1 - s) / (s + 1e-4))) ** 2 + 0.3 for s in (0.0, 0.25, 1.0)]
    assert torch.allclose(snr.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5)


# --- the families --------------------------------------------------------------------------------


class _Recorder(nn.Module):
    """A denoiser that records its noisy input and predicts ``scale * noisy`` (a known prediction)."""

    def __init__(self, scale: float = 0.5):
        super().__init__()
        self.scale = scale
        self.inputs: list[torch.Tensor] = []

    def forward(self, noisy, timesteps, embeds, return_dict=False):
        self.inputs.append(noisy.detach().clone())
        return (noisy * self.scale,)


def _sd_case(make_config, **overrides):
    spec = get_model_spec(validate_config(make_config(**overrides)))
    gen = torch.Generator().manual_seed(11)
    latents = torch.randn(3, 4, 8, 8, generator=gen)
    cond = {"prompt_embeds": torch.randn(3, 6, 32, generator=gen)}
    return spec, latents, cond


def test_l2_is_bit_for_bit_the_old_mean_squared_error(make_config):
    spec, latents, cond = _sd_case(make_config)
    unet = spec.load_denoiser().eval()
    with torch.no_grad():
        got = spec.training_loss(unet, latents, cond, torch.Generator().manual_seed(3))
        # The loss as the family computed it before loss_type existed, step by step.
        scheduler = spec.load_noise_scheduler()
        g = torch.Generator().manual_seed(3)
        noise = torch.randn(latents.shape, generator=g, dtype=torch.float32)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (3,), generator=g)
        noisy = scheduler.add_noise(latents, noise, timesteps)
        pred = unet(noisy, timesteps, cond["prompt_embeds"], return_dict=False)[0]
        want = F.mse_loss(pred.float(), noise.float(), reduction="none").mean(dim=(1, 2, 3))
    assert torch.equal(got, want)


@pytest.mark.parametrize("loss_type", ["huber", "smooth_l1"])
@pytest.mark.parametrize("schedule", ["snr", "exponential", "constant"])
def test_sd_huber_loss_by_hand(make_config, loss_type, schedule):
    spec, latents, cond = _sd_case(make_config, loss_type=loss_type, huber_schedule=schedule, huber_c=0.2)
    model = _Recorder(0.5)
    got = spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))
    scheduler = spec.load_noise_scheduler()
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(latents.shape, generator=g).double()
    timesteps = torch.randint(0, 1000, (3,), generator=g)
    a = scheduler.alphas_cumprod.double()[timesteps].view(-1, 1, 1, 1)
    noisy = a.sqrt() * latents.double() + (1 - a).sqrt() * noise
    d = 0.5 * noisy - noise  # epsilon target
    if schedule == "constant":
        c = torch.full((3, 1, 1, 1), 0.2, dtype=torch.float64)
    elif schedule == "exponential":
        c = (0.2 ** (timesteps.double() / 1000)).view(-1, 1, 1, 1)
    else:
        c = (1 - 0.2) / (1 + ((1 - a) / a).sqrt()) ** 2 + 0.2
    curve = 2 * (torch.sqrt(d**2 + c**2) - c)
    want = ((c if loss_type == "huber" else 1) * curve).mean(dim=(1, 2, 3))
    assert got.shape == (3,)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-7), (got, want)
    l2 = (d**2).mean(dim=(1, 2, 3))
    assert not torch.allclose(got.double(), l2, rtol=1e-2)


def test_min_snr_weights_still_multiply_the_huber_loss(make_config):
    spec, latents, cond = _sd_case(make_config, loss_type="huber", huber_schedule="constant")
    plain = spec.training_loss(_Recorder(), latents, cond, torch.Generator().manual_seed(3))
    spec_w, _, _ = _sd_case(
        make_config, loss_type="huber", huber_schedule="constant", loss_weighting="min_snr", snr_gamma=1.0
    )
    weighted = spec_w.training_loss(_Recorder(), latents, cond, torch.Generator().manual_seed(3))
    timesteps = torch.randint(0, 1000, (3,), generator=_after_noise(3, latents.shape))
    a = spec.load_noise_scheduler().alphas_cumprod[timesteps].double()
    snr = a / (1 - a)
    assert torch.allclose(weighted.double(), plain.double() * snr.clamp(max=1.0) / snr, rtol=1e-5)


def _after_noise(seed: int, shape) -> torch.Generator:
    g = torch.Generator().manual_seed(seed)
    torch.randn(shape, generator=g)
    return g


def _family_config(make_config, family: str, **overrides):
    """A validated config of ``family`` that reads no model folder (a hub id, files unchecked)."""
    raw = make_config(pretrained_model_name_or_path="some-org/some-model", model_family=family, **overrides)
    return validate_config(raw, check_files=False)


@pytest.mark.parametrize("loss_type", ["huber", "smooth_l1"])
def test_flow_huber_loss_by_hand(make_config, loss_type):
    cfg = _family_config(make_config, "sd3", flow_shift=1.0, loss_type=loss_type, huber_schedule="snr", huber_c=0.1)
    spec = get_model_spec(cfg)
    latents = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(5))
    got = spec.flow_loss(latents, torch.Generator().manual_seed(3), lambda noisy, sigmas: 0.25 * noisy)
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(latents.shape, generator=g).double()
    sigmas = torch.rand(2, generator=g).double()  # uniform sampling, shift 1
    s = sigmas.view(-1, 1, 1, 1)
    noisy = (1 - s) * latents.double() + s * noise
    d = 0.25 * noisy - (noise - latents.double())
    c = (1 - 0.1) / (1 + ((1 - s) / (s + 1e-4)).sqrt()) ** 2 + 0.1
    want = ((c if loss_type == "huber" else 1) * 2 * (torch.sqrt(d**2 + c**2) - c)).mean(dim=(1, 2, 3))
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-7), (got, want)


# --- noise offset ----------------------------------------------------------------------------


def _offset_draws(seed: int, shape, probability: float):
    """The spec's draw order redone: noise, timesteps, then (probability < 1) the gate, then the
    offsets. Returns (noise, timesteps, offsets or None, state after)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(shape, generator=g)
    timesteps = torch.randint(0, 1000, (shape[0],), generator=g)
    applied = probability >= 1 or torch.rand(1, generator=g).item() < probability
    offsets = torch.randn(shape[0], shape[1], 1, 1, generator=g) if applied else None
    return noise, timesteps, offsets, g.get_state()


@pytest.mark.parametrize("probability", [1.0, 0.5])
def test_noise_offset_is_the_drawn_noise_plus_offset_times_randn_bc11(make_config, probability):
    spec, latents, cond = _sd_case(make_config, noise_offset=0.1, noise_offset_probability=probability)
    scheduler = spec.load_noise_scheduler()
    seen = set()
    for seed in range(40):
        noise, timesteps, offsets, state_after = _offset_draws(seed, latents.shape, probability)
        used = noise if offsets is None else noise + 0.1 * offsets
        model = _Recorder(0.0)  # predicts 0: the epsilon loss is mean(noise^2) of the noise used
        gen = torch.Generator().manual_seed(seed)
        got = spec.training_loss(model, latents, cond, gen)
        assert torch.allclose(model.inputs[0], scheduler.add_noise(latents, used, timesteps), atol=1e-6)
        assert torch.allclose(got, (used**2).mean(dim=(1, 2, 3)), rtol=1e-6)
        assert torch.equal(gen.get_state(), state_after)  # nothing else drawn
        seen.add(offsets is not None)
        if seen == ({True} if probability == 1.0 else {True, False}):
            break
    assert seen == ({True} if probability == 1.0 else {True, False})


def test_no_offset_draws_nothing_more(make_config):
    spec, latents, cond = _sd_case(make_config, noise_offset_probability=0.5)  # noise_offset 0: off
    gen = torch.Generator().manual_seed(4)
    spec.training_loss(_Recorder(), latents, cond, gen)
    g = _after_noise(4, latents.shape)
    torch.randint(0, 1000, (3,), generator=g)
    assert torch.equal(gen.get_state(), g.get_state())


def test_noise_offset_is_refused_for_flow_matching_families(make_config):
    for family in ("sd3", "flux", "wan"):
        with pytest.raises(ValueError, match=f"noise_offset 0.1 is offset noise for DDPM.*'{family}'.*remove"):
            _family_config(make_config, family, noise_offset=0.1)
    assert _family_config(make_config, "sdxl", noise_offset=0.1).noise_offset == 0.1
    assert _family_config(make_config, "sd3").noise_offset == 0.0


def test_bad_values_are_refused(make_config):
    with pytest.raises(ValueError, match="loss_type"):
        validate_config(make_config(loss_type="l1"))
    with pytest.raises(ValueError, match="huber_c"):
        validate_config(make_config(huber_c=0))
    with pytest.raises(ValueError, match="noise_offset_probability"):
        validate_config(make_config(noise_offset_probability=1.5))
