"""Flux's embedded training guidance (``flux_guidance_*``, SimpleTuner's keys and meaning), the sign of
``logit_mean`` (diffusers' scripts'), and ``loss_weighting: sigma_squared`` (diffusers' SD3 script's
output preconditioning), on the tiny zoo models.

Expected values that claim equality with another tool are figures computed once from its code:

* SimpleTuner (commit bc8e6ab7): defaults from ``simpletuner/helpers/models/field_registry/flux.py``
  (``flux_guidance_mode`` "constant" l.92, ``flux_guidance_value`` 1.0 l.144, ``flux_guidance_min`` 0.0
  l.162, ``flux_guidance_max`` 4.0 l.180); the draw in ``simpletuner/helpers/models/flux/model.py``
  ``_flux_guidance_scales`` l.681-705: ``constant`` repeats the value for the batch (l.683),
  ``random-range`` draws one ``random.uniform(min, max)`` per sample (l.697-703).
* diffusers (snapshot 58eb52c): ``src/diffusers/training_utils.py`` l.381-383 draws
  ``u = sigmoid(N(logit_mean, logit_std))``; ``examples/dreambooth/train_dreambooth_lora_sd3.py``
  l.1784-1797 looks ``u`` up in the flow scheduler's descending table (``timesteps[(u * 1000).long()]``,
  then ``get_sigmas`` l.1711-1720). Sigma quantiles of that lookup (shift 1, std 1, 1,000,000 draws
  of seed 1234, run once with diffusers 0.42.1's ``compute_density_for_timestep_sampling`` and
  ``FlowMatchEulerDiscreteScheduler(1000, shift=1.0)``): ``SCRIPT_SIGMA_QUANTILES`` below.
  The same script's preconditioning l.1810-1821: ``pred * (-sigma) + noisy`` against the clean latents.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from simpletuner.configuration import validate_config
from simpletuner.configuration.families import FAMILY_ONLY_KEYS
from simpletuner.models import get_model_spec
from simpletuner.models import noise as noise_lib
from simpletuner.models.flux import T5_MAX_LENGTH
from simpletuner.models.sd3 import T5_MAX_LENGTH as SD3_T5_MAX_LENGTH
from simpletuner.testing.zoo import (
    TINY_FLUX_CLIP_HIDDEN,
    TINY_FLUX_T5_WIDTH,
    TINY_SD3_CLIP_PROJECTION,
    TINY_SD3_T5_WIDTH,
)
from simpletuner.training.validation import pipeline_arguments

#: SimpleTuner's defaults of the four keys (field_registry/flux.py l.92, 144, 162, 180).
SIMPLETUNER_DEFAULTS = {
    "flux_guidance_mode": "constant",
    "flux_guidance_value": 1.0,
    "flux_guidance_min": 0.0,
    "flux_guidance_max": 4.0,
}
#: q10 / q50 / q90 of the sigma diffusers' flow scripts train on, per logit_mean (see the module docstring).
SCRIPT_SIGMA_QUANTILES = {
    -0.5: (0.314, 0.623, 0.856),
    0.0: (0.218, 0.500, 0.783),
    0.5: (0.144, 0.378, 0.686),
}


@pytest.fixture
def flux_config(zoo_config):
    def _make(**overrides):
        return validate_config(zoo_config("flux", **overrides))

    return _make


@pytest.fixture(scope="module")
def schnell_like(tmp_path_factory):
    """The tiny Flux folder with a transformer that has no guidance embedding (as FLUX.1-schnell)."""
    from diffusers import FluxTransformer2DModel

    from simpletuner.testing.zoo import write_tiny_model

    folder = write_tiny_model("flux", tmp_path_factory.mktemp("schnell") / "model")
    config = json.loads((folder / "transformer" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")} | {"guidance_embeds": False}
    shutil.rmtree(folder / "transformer")
    FluxTransformer2DModel.from_config(config).save_pretrained(folder / "transformer")
    return folder


def _cond(batch: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {
        "prompt_embeds": torch.randn(batch, T5_MAX_LENGTH, TINY_FLUX_T5_WIDTH, generator=gen),
        "pooled_prompt_embeds": torch.randn(batch, TINY_FLUX_CLIP_HIDDEN, generator=gen),
    }


def _guidance_seen(cfg, seed: int, batch: int = 4) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The ``guidance`` the transformer received in one training loss, and that loss."""
    spec = get_model_spec(cfg)
    model = spec.load_denoiser().eval()
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["guidance"]), with_kwargs=True)
    latents = torch.randn(batch, 16, 4, 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        loss = spec.training_loss(model, latents, _cond(batch), torch.Generator().manual_seed(seed))
    assert len(seen) == 1
    return seen[0], loss


# --- Flux guidance ---------------------------------------------------------------------------------------


def test_defaults_are_simpletuners(flux_config):
    cfg = flux_config()
    assert {key: getattr(cfg, key) for key in SIMPLETUNER_DEFAULTS} == SIMPLETUNER_DEFAULTS
    assert {key: default for key, (_, default) in FAMILY_ONLY_KEYS.items()} == SIMPLETUNER_DEFAULTS


@pytest.mark.parametrize("value", [1.0, 3.5])
def test_constant_value_reaches_the_transformer(flux_config, value):
    overrides = {} if value == 1.0 else {"flux_guidance_value": value}
    guidance, loss = _guidance_seen(flux_config(**overrides), seed=3)
    assert guidance.dtype == torch.float32 and torch.equal(guidance, torch.full((4,), value))
    if value != 1.0:  # the value changes what is trained
        assert not torch.allclose(loss, _guidance_seen(flux_config(), seed=3)[1])


def test_constant_mode_draws_nothing(flux_config):
    """The noise and sigmas of a constant-guidance step are those of the run's generator as before the keys."""
    spec = get_model_spec(flux_config(flux_guidance_value=3.5))
    gen = torch.Generator().manual_seed(3)
    spec.training_guidance(4, gen)
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(3).get_state())


def test_random_range_draws_per_sample_from_the_runs_generator(flux_config):
    cfg = flux_config(flux_guidance_mode="random-range", flux_guidance_min=1.5, flux_guidance_max=4.5)
    guidance, loss = _guidance_seen(cfg, seed=3, batch=6)
    assert ((guidance >= 1.5) & (guidance < 4.5)).all()
    assert len(set(guidance.tolist())) == 6  # one draw per sample, as SimpleTuner's
    # Drawn first from the loss's generator: reproducible for the same seed (a resumed run restores it) ...
    assert torch.equal(guidance, 1.5 + 3.0 * torch.rand(6, generator=torch.Generator().manual_seed(3)))
    again, loss_again = _guidance_seen(cfg, seed=3, batch=6)
    assert torch.equal(again, guidance) and torch.equal(loss_again, loss)
    # ... and another step (generator state) draws other values.
    assert not torch.equal(_guidance_seen(cfg, seed=4, batch=6)[0], guidance)


def test_random_range_is_uniform_over_the_range(flux_config):
    spec = get_model_spec(flux_config(flux_guidance_mode="random-range"))  # SimpleTuner's [0, 4]
    draws = spec.training_guidance(20000, torch.Generator().manual_seed(0))
    assert draws.min() >= 0.0 and draws.max() < 4.0
    assert draws.mean().item() == pytest.approx(2.0, abs=0.05)
    counts = torch.histc(draws, bins=4, min=0.0, max=4.0) / draws.numel()
    assert torch.allclose(counts, torch.full((4,), 0.25), atol=0.02)
    pinned = get_model_spec(flux_config(flux_guidance_mode="random-range", flux_guidance_min=2, flux_guidance_max=2))
    assert torch.equal(pinned.training_guidance(3, torch.Generator()), torch.full((3,), 2.0))


def test_range_must_be_ordered(flux_config):
    with pytest.raises(ValueError, match="flux_guidance_min 5.0 is greater than flux_guidance_max 4.0"):
        flux_config(flux_guidance_mode="random-range", flux_guidance_min=5.0)
    with pytest.raises(ValueError, match="flux_guidance_value"):
        flux_config(flux_guidance_value=-1.0)


def test_a_model_without_guidance_embedding_refuses_a_set_value(make_config, schnell_like):
    def schnell(**overrides):
        raw = make_config(pretrained_model_name_or_path=str(schnell_like), model_family="flux", **overrides)
        return get_model_spec(validate_config(raw))

    for overrides in (
        {"flux_guidance_value": 3.5},
        {"flux_guidance_mode": "random-range"},
        {"flux_guidance_max": 6.0},
    ):
        key = next(iter(overrides))
        with pytest.raises(ValueError, match=f"{key}.*no guidance embedding.*remove {key}"):
            schnell(**overrides)
    # Defaults (also written out) are accepted and train without guidance.
    spec = schnell(flux_guidance_value=1.0)
    model = spec.load_denoiser().eval()
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["guidance"]), with_kwargs=True)
    with torch.no_grad():
        spec.training_loss(model, torch.randn(2, 16, 4, 4), _cond(2), torch.Generator().manual_seed(0))
    assert seen == [None]


@pytest.mark.parametrize("family", ["sd", "sd3", "wan"])
def test_other_families_refuse_a_set_value(zoo_config, make_config, family):
    raw = make_config() if family == "sd" else zoo_config(family)
    with pytest.raises(ValueError, match="flux_guidance_value 3.5 is read only by model_family 'flux'.*remove"):
        validate_config({**raw, "flux_guidance_value": 3.5})
    with pytest.raises(ValueError, match="flux_guidance_mode 'random-range' is read only by model_family 'flux'"):
        validate_config({**raw, "flux_guidance_mode": "random-range"})
    assert validate_config({**raw, "flux_guidance_value": 1.0}).flux_guidance_value == 1.0


def test_validation_renders_with_validation_guidance_scale(flux_config):
    cfg = flux_config(flux_guidance_value=3.5, validation_guidance_scale=2.0)
    assert pipeline_arguments("flux", cfg, 64, 64)["guidance_scale"] == 2.0


def test_memory_estimate_is_the_same_with_random_range(flux_config):
    """The estimator's fake step draws the guidance too (a [B] tensor either way): nothing changes."""
    from simpletuner.memory.estimator import estimate_memory

    drawn = estimate_memory(flux_config(flux_guidance_mode="random-range"), device_kind="cpu")
    assert drawn.total == estimate_memory(flux_config(), device_kind="cpu").total > 0


# --- logit_mean: diffusers' sign ---------------------------------------------------------------------------


@pytest.mark.parametrize("mean", [-0.5, 0.0, 0.5])
def test_logit_normal_sigmas_match_diffusers_scripts(zoo_config, mean):
    raw = zoo_config("sd3", timestep_sampling="logit_normal", logit_mean=mean, flow_shift=1.0)
    spec = get_model_spec(validate_config(raw))
    sigmas = spec.sample_sigmas(20000, torch.Generator().manual_seed(0)).double()
    got = torch.quantile(sigmas, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    # 20,000 draws: a quantile's standard error is about 0.003 here; the script's 1000-entry table adds <= 0.001.
    assert got.tolist() == pytest.approx(SCRIPT_SIGMA_QUANTILES[mean], abs=0.01)


def test_logit_mean_0_draws_what_it_always_drew():
    for std in (1.0, 1.5):
        got = noise_lib.sample_u(64, torch.Generator().manual_seed(9), "logit_normal", 0.0, std)
        before = torch.sigmoid(torch.randn(64, generator=torch.Generator().manual_seed(9)) * std + 0.0)
        assert torch.equal(got, before)
    # The first draws of seed 9 before the sign change (`sigmoid(randn * std + logit_mean)`, recorded once).
    first = noise_lib.sample_u(3, torch.Generator().manual_seed(9), "logit_normal").tolist()
    assert first == [0.5111799836158752, 0.8711583018302917, 0.4424978196620941]


def test_ddpm_timesteps_follow_the_same_sign():
    """Positive logit_mean: fewer noisy steps for DDPM families too (timestep u * T)."""
    high = noise_lib.ddpm_timesteps(
        noise_lib.sample_u(4000, torch.Generator().manual_seed(1), "logit_normal", 1.0), 1000
    )
    low = noise_lib.ddpm_timesteps(
        noise_lib.sample_u(4000, torch.Generator().manual_seed(1), "logit_normal", -1.0), 1000
    )
    assert high.float().median() < 300 < 700 < low.float().median()


# --- loss_weighting sigma_squared: diffusers' SD3 script with --precondition_outputs 1 -----------------------


def test_sigma_squared_is_the_sd3_scripts_preconditioned_loss(zoo_config):
    def spec_of(weighting):
        return get_model_spec(validate_config(zoo_config("sd3", loss_weighting=weighting, flow_shift=3.0)))

    spec = spec_of("sigma_squared")
    model = spec.load_denoiser().eval()
    calls = []
    model.register_forward_hook(lambda m, args, kwargs, out: calls.append((kwargs, out[0])), with_kwargs=True)
    gen = torch.Generator().manual_seed(7)
    latents = torch.randn(3, 16, 8, 8, generator=gen)
    cond = {
        "prompt_embeds": torch.randn(3, 77 + SD3_T5_MAX_LENGTH, TINY_SD3_T5_WIDTH, generator=gen),
        "pooled_prompt_embeds": torch.randn(3, sum(TINY_SD3_CLIP_PROJECTION), generator=gen),
    }
    with torch.no_grad():
        got = spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))
        plain = spec_of("none").training_loss(model, latents, cond, torch.Generator().manual_seed(3))
    (inputs, pred), _ = calls
    noisy, sigmas = inputs["hidden_states"], inputs["timestep"] / 1000
    s = sigmas.view(-1, 1, 1, 1)
    # train_dreambooth_lora_sd3.py l.1810-1821, 1838-1841 (its weighting_scheme logit_normal weighs 1).
    want = ((pred * (-s) + noisy - latents) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert torch.allclose(got, plain * sigmas**2, atol=1e-6, rtol=1e-5)


def test_sigma_squared_is_a_flow_weighting(make_config):
    with pytest.raises(ValueError, match="sigma_squared is a flow-matching weighting.*'sd'"):
        validate_config(make_config(loss_weighting="sigma_squared"))
