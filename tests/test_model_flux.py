"""The flux family on its tiny zoo model: loading, prompt encoding as FluxPipeline does it, latent
packing, the flow-matching loss by hand (dynamic and static shift, guidance embedding). LoRA
training, reload in diffusers and the memory estimate: test_families.py."""

from __future__ import annotations

import math

import pytest
import torch

from simpletuner.configuration import validate_config
from simpletuner.models import FluxSpec, get_model_spec
from simpletuner.models import noise as noise_lib
from simpletuner.models.flux import T5_MAX_LENGTH
from simpletuner.models.packed import pack_latents, unpack_latents
from simpletuner.testing.zoo import TINY_FLUX_CLIP_HIDDEN, TINY_FLUX_T5_WIDTH


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    return write_tiny_model("flux", tmp_path_factory.mktemp("tiny_flux") / "model")


@pytest.fixture
def flux_config(make_config, tiny_flux):
    def _make(**overrides):
        return make_config(**{"pretrained_model_name_or_path": str(tiny_flux), "model_family": "flux", **overrides})

    return _make


def _cond(gen, batch=2):
    return {
        "prompt_embeds": torch.randn(batch, T5_MAX_LENGTH, TINY_FLUX_T5_WIDTH, generator=gen),
        "pooled_prompt_embeds": torch.randn(batch, TINY_FLUX_CLIP_HIDDEN, generator=gen),
    }


def _call(model, packed, timestep, cond, h, w):
    """The transformer call FluxPipeline makes (timestep already / 1000)."""
    from diffusers import FluxPipeline

    b = packed.shape[0]
    return model(
        hidden_states=packed,
        timestep=timestep,
        guidance=torch.full((b,), 1.0),  # flux_guidance_value's default
        pooled_projections=cond["pooled_prompt_embeds"],
        encoder_hidden_states=cond["prompt_embeds"],
        txt_ids=torch.zeros(cond["prompt_embeds"].shape[1], 3),
        img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32),
        return_dict=False,
    )[0]


def test_zoo_folder_loads_and_is_checked(flux_config, tiny_flux):
    spec = get_model_spec(validate_config(flux_config()))
    assert isinstance(spec, FluxSpec) and spec.dynamic_shift
    transformer = spec.load_denoiser()
    assert type(transformer).__name__ == "FluxTransformer2DModel"
    assert transformer.config.in_channels == 64 and transformer.config.guidance_embeds
    encoders = spec.load_text_encoders(torch.device("cpu"), torch.float32)
    assert sorted(encoders) == ["text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"]
    vae = spec.load_vae(torch.device("cpu"), torch.float32)
    assert vae.config.latent_channels == 16 and vae.config.shift_factor
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    want = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    assert torch.allclose(spec.encode_images(vae, pixels), want, atol=1e-6)
    assert not get_model_spec(validate_config(flux_config(flow_shift=2.0))).dynamic_shift


def test_packing_round_trips():
    from diffusers import FluxPipeline

    x = torch.randn(2, 16, 8, 6)
    packed = pack_latents(x)
    assert packed.shape == (2, 4 * 3, 64)
    assert torch.equal(unpack_latents(packed, 8, 6), x)
    # The pipeline's own unpack (pixel sides, VAE factor 8) agrees.
    assert torch.equal(FluxPipeline._unpack_latents(packed, 64, 48, 8), x)


def test_prompts_match_the_diffusers_pipeline(flux_config, tiny_flux):
    from diffusers import FluxPipeline

    captions = ["a red square", "a blue circle on grey"]
    spec = get_model_spec(validate_config(flux_config()))
    encoders = spec.load_text_encoders(torch.device("cpu"), torch.float32)
    out = spec.encode_prompts(encoders, captions)
    for cond in out:
        assert cond["prompt_embeds"].shape == (T5_MAX_LENGTH, TINY_FLUX_T5_WIDTH)
        assert cond["pooled_prompt_embeds"].shape == (TINY_FLUX_CLIP_HIDDEN,)
    pipe = FluxPipeline.from_pretrained(str(tiny_flux), use_safetensors=True)
    with torch.no_grad():  # as in the pipeline's __call__
        embeds, pooled, text_ids = pipe.encode_prompt(captions, None, device="cpu")
    got = torch.stack([c["prompt_embeds"] for c in out])
    assert torch.allclose(got, embeds, atol=1e-6)
    assert torch.allclose(torch.stack([c["pooled_prompt_embeds"] for c in out]), pooled, atol=1e-6)
    assert not torch.allclose(got[0], got[1])
    assert text_ids.shape == (T5_MAX_LENGTH, 3) and not text_ids.any()

    sampler = spec.build_pipeline(spec.load_denoiser(), spec.load_vae(torch.device("cpu"), torch.float32), encoders)
    sampler.set_progress_bar_config(disable=True)
    images = sampler(
        "a red square",
        num_inference_steps=2,
        guidance_scale=3.5,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
    ).images
    assert images[0].size == (64, 64)


@pytest.mark.parametrize("weighting,flow_shift", [("none", None), ("sigma_sqrt", None), ("cosmap", 2.0), ("none", 2.0)])
def test_loss_is_the_flow_matching_formula(flux_config, weighting, flow_shift):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    cfg = validate_config(
        flux_config(timestep_sampling="logit_normal", logit_mean=0.2, flow_shift=flow_shift, loss_weighting=weighting)
    )
    spec = get_model_spec(cfg)
    model = spec.load_denoiser().eval()
    gen = torch.Generator().manual_seed(7)
    latents = torch.randn(3, 16, 8, 12, generator=gen)
    cond = _cond(gen, 3)
    with torch.no_grad():
        got = spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))

        g = torch.Generator().manual_seed(3)
        noise = torch.randn(latents.shape, generator=g)
        u = torch.sigmoid(torch.randn(3, generator=g) * 1.0 - 0.2)  # logit_mean: diffusers' sign
        if flow_shift is None:  # Flux dev's dynamic shift at 4 x 6 = 24 packed tokens
            mu = calculate_shift(24, 256, 4096, 0.5, 1.15)
            sigmas = math.exp(mu) / (math.exp(mu) + (1 / u - 1))
        else:
            sigmas = flow_shift * u / (1 + (flow_shift - 1) * u)
        s = sigmas.view(-1, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        pred = _call(model, pack_latents(noisy), sigmas, cond, 8, 12)
        # Compared unpacked: the packed-space loss is the same mean.
        want = ((unpack_latents(pred, 8, 12) - (noise - latents)) ** 2).mean(dim=(1, 2, 3))
        if weighting != "none":
            want = want * noise_lib.flow_weights(sigmas, weighting)
    assert got.shape == (3,)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_weighting_is_checked_for_flux(flux_config):
    with pytest.raises(ValueError, match="min_snr is for DDPM.*'flux'"):
        validate_config(flux_config(loss_weighting="min_snr"))
