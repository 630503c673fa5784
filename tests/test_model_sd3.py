"""The sd3 family on its tiny zoo model: loading, prompt encoding as StableDiffusion3Pipeline does
it (with and without T5), the flow-matching loss by hand, weighting validation. LoRA training,
reload in diffusers and the memory estimate: test_families.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from simpletuner.configuration import validate_config
from simpletuner.models import StableDiffusion3Spec, get_model_spec
from simpletuner.models import noise as noise_lib
from simpletuner.models.sd3 import T5_MAX_LENGTH
from simpletuner.testing.zoo import TINY_SD3_CLIP_PROJECTION, TINY_SD3_T5_WIDTH

POOLED = sum(TINY_SD3_CLIP_PROJECTION)
SEQ = 77 + T5_MAX_LENGTH


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    return write_tiny_model("sd3", tmp_path_factory.mktemp("tiny_sd3") / "model")


@pytest.fixture(scope="module")
def tiny_sd3_no_t5(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_sd3

    return write_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_no_t5") / "model", with_t5=False)


@pytest.fixture
def sd3_config(make_config, tiny_sd3):
    def _make(**overrides):
        return make_config(**{"pretrained_model_name_or_path": str(tiny_sd3), "model_family": "sd3", **overrides})

    return _make


def test_zoo_folder_loads_and_is_checked(sd3_config, tiny_sd3, tmp_path):
    spec = get_model_spec(validate_config(sd3_config()))
    assert isinstance(spec, StableDiffusion3Spec) and spec.has_t5
    transformer = spec.load_denoiser()
    assert type(transformer).__name__ == "SD3Transformer2DModel"
    assert transformer.config.in_channels == 16 and transformer.config.joint_attention_dim == TINY_SD3_T5_WIDTH
    encoders = spec.load_text_encoders(torch.device("cpu"), torch.float32)
    assert sorted(encoders) == [
        "text_encoder",
        "text_encoder_2",
        "text_encoder_3",
        "tokenizer",
        "tokenizer_2",
        "tokenizer_3",
    ]
    vae = spec.load_vae(torch.device("cpu"), torch.float32)
    assert vae.config.latent_channels == 16 and vae.config.shift_factor
    assert spec.shift == 3.0
    assert spec.text_encoder_identity() != spec._identity("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")
    # Latents: (mode - shift_factor) * scaling_factor.
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    want = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    assert torch.allclose(spec.encode_images(vae, pixels), want, atol=1e-6)

    bad = tmp_path / "bad"
    shutil.copytree(tiny_sd3, bad)
    index = json.loads((bad / "model_index.json").read_text())
    index["text_encoder_3"] = ["transformers", "CLIPTextModel"]
    (bad / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="text_encoder_3.*T5EncoderModel"):
        get_model_spec(validate_config(sd3_config(pretrained_model_name_or_path=str(bad))))


def test_prompts_match_the_diffusers_pipeline_with_and_without_t5(sd3_config, tiny_sd3, tiny_sd3_no_t5):
    from diffusers import StableDiffusion3Pipeline

    captions = ["a red square", "a blue circle on grey"]
    for folder in (tiny_sd3, tiny_sd3_no_t5):
        spec = get_model_spec(validate_config(sd3_config(pretrained_model_name_or_path=str(folder))))
        encoders = spec.load_text_encoders(torch.device("cpu"), torch.float32)
        assert ("text_encoder_3" in encoders) == (folder == tiny_sd3) == spec.has_t5
        out = spec.encode_prompts(encoders, captions)
        for cond in out:
            assert cond["prompt_embeds"].shape == (SEQ, TINY_SD3_T5_WIDTH)
            assert cond["pooled_prompt_embeds"].shape == (POOLED,)
        extra = {} if spec.has_t5 else {"text_encoder_3": None, "tokenizer_3": None}
        pipe = StableDiffusion3Pipeline.from_pretrained(str(folder), use_safetensors=True, **extra)
        with torch.no_grad():  # as in the pipeline's __call__
            embeds, _, pooled, _ = pipe.encode_prompt(
                captions, None, None, device="cpu", do_classifier_free_guidance=False
            )
        got = torch.stack([c["prompt_embeds"] for c in out])
        assert torch.allclose(got, embeds, atol=1e-6)
        assert torch.allclose(torch.stack([c["pooled_prompt_embeds"] for c in out]), pooled, atol=1e-6)
        assert not torch.allclose(got[0], got[1])
        if not spec.has_t5:
            assert torch.count_nonzero(got[:, 77:]) == 0

        # The validation pipeline samples with the (untrained) model.
        sampler = spec.build_pipeline(spec.load_denoiser(), spec.load_vae(torch.device("cpu"), torch.float32), encoders)
        sampler.set_progress_bar_config(disable=True)
        images = sampler(
            "a red square",
            num_inference_steps=2,
            guidance_scale=3.0,
            height=64,
            width=64,
            generator=torch.Generator().manual_seed(0),
        ).images
        assert images[0].size == (64, 64)


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
def test_loss_is_the_flow_matching_formula(sd3_config, weighting):
    cfg = validate_config(
        sd3_config(timestep_sampling="logit_normal", logit_mean=0.2, flow_shift=2.0, loss_weighting=weighting)
    )
    spec = get_model_spec(cfg)
    model = spec.load_denoiser().eval()
    gen = torch.Generator().manual_seed(7)
    latents = torch.randn(3, 16, 8, 8, generator=gen)
    cond = {
        "prompt_embeds": torch.randn(3, SEQ, TINY_SD3_T5_WIDTH, generator=gen),
        "pooled_prompt_embeds": torch.randn(3, POOLED, generator=gen),
    }
    with torch.no_grad():
        got = spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))

        g = torch.Generator().manual_seed(3)
        noise = torch.randn(latents.shape, generator=g)
        u = torch.sigmoid(torch.randn(3, generator=g) * 1.0 - 0.2)  # logit_mean: diffusers' sign
        sigmas = 2.0 * u / (1 + (2.0 - 1) * u)
        s = sigmas.view(-1, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        pred = model(
            hidden_states=noisy,
            timestep=sigmas * 1000,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
            return_dict=False,
        )[0]
        want = ((pred - (noise - latents)) ** 2).mean(dim=(1, 2, 3))
        if weighting != "none":
            want = want * noise_lib.flow_weights(sigmas, weighting)
    assert got.shape == (3,)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_weighting_is_checked_against_the_family(sd3_config, make_config):
    with pytest.raises(ValueError, match="min_snr is for DDPM.*'sd3'"):
        validate_config(sd3_config(loss_weighting="min_snr"))
    for family in ("sd", "sdxl"):
        for kind in ("sigma_sqrt", "cosmap"):
            with pytest.raises(ValueError, match=f"{kind} is a flow-matching weighting.*'{family}'"):
                validate_config(make_config(model_family=family, loss_weighting=kind))
    assert validate_config(make_config(loss_weighting="min_snr")).loss_weighting == "min_snr"
    assert validate_config(sd3_config(loss_weighting="cosmap", flow_shift=1.0)).flow_shift == 1.0
