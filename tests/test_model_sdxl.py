"""The sdxl family on its tiny zoo model: loading, prompt encoding and time ids as the diffusers
pipeline makes them. LoRA training, reload in diffusers and the estimate: test_families.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from simpletuner.configuration import validate_config
from simpletuner.models import StableDiffusionXLSpec, get_model_spec
from simpletuner.testing.zoo import TINY_SDXL_HIDDEN, TINY_SDXL_PROJECTION


@pytest.fixture(scope="module")
def tiny_sdxl(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    return write_tiny_model("sdxl", tmp_path_factory.mktemp("tiny_sdxl") / "model")


@pytest.fixture
def sdxl_config(make_config, tiny_sdxl):
    def _make(**overrides):
        return make_config(**{"pretrained_model_name_or_path": str(tiny_sdxl), "model_family": "sdxl", **overrides})

    return _make


@pytest.fixture(scope="module")
def pipe(tiny_sdxl):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(str(tiny_sdxl), use_safetensors=True, add_watermarker=False)


def test_zoo_folder_loads_and_is_checked(sdxl_config, tiny_sdxl, tmp_path):
    spec = get_model_spec(validate_config(sdxl_config()))
    assert isinstance(spec, StableDiffusionXLSpec)
    unet = spec.load_denoiser()
    assert unet.config.addition_embed_type == "text_time"
    assert unet.config.cross_attention_dim == sum(TINY_SDXL_HIDDEN)
    encoders = spec.load_text_encoders(torch.device("cpu"), torch.float32)
    assert sorted(encoders) == ["text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"]
    assert type(encoders["text_encoder_2"]).__name__ == "CLIPTextModelWithProjection"
    assert spec.vae_scale_factor == 8
    assert spec.prediction_type == "epsilon"
    # The text-embed cache key covers both encoders.
    assert spec.text_encoder_identity() != spec._identity("tokenizer", "text_encoder")

    # A folder naming the wrong class for the second encoder is refused before anything loads.
    bad = tmp_path / "bad"
    shutil.copytree(tiny_sdxl, bad)
    index = json.loads((bad / "model_index.json").read_text())
    index["text_encoder_2"] = ["transformers", "CLIPTextModel"]
    (bad / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="text_encoder_2.*CLIPTextModelWithProjection"):
        get_model_spec(validate_config(sdxl_config(pretrained_model_name_or_path=str(bad))))


def test_prompts_and_time_ids_match_the_diffusers_pipeline(sdxl_config, pipe):
    spec = get_model_spec(validate_config(sdxl_config()))
    encoders = spec.load_text_encoders(torch.device("cpu"), torch.float32)
    captions = ["a red square", "a blue circle on grey"]
    out = spec.encode_prompts(encoders, captions)
    assert len(out) == 2
    for cond in out:
        assert cond["prompt_embeds"].shape == (77, sum(TINY_SDXL_HIDDEN))
        assert cond["pooled_prompt_embeds"].shape == (TINY_SDXL_PROJECTION,)
    embeds, _, pooled, _ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
    assert torch.allclose(torch.stack([c["prompt_embeds"] for c in out]), embeds, atol=1e-6)
    assert torch.allclose(torch.stack([c["pooled_prompt_embeds"] for c in out]), pooled, atol=1e-6)
    assert not torch.allclose(out[0]["pooled_prompt_embeds"], out[1]["pooled_prompt_embeds"])

    # Time ids of a 48x64 (h x w) bucket: what the pipeline passes when sampling at that size.
    latents = torch.zeros(3, 4, 6, 8)
    want = pipe._get_add_time_ids(
        (48, 64), (0, 0), (48, 64), torch.float32, text_encoder_projection_dim=TINY_SDXL_PROJECTION
    )
    assert torch.equal(spec.time_ids(latents), want.expand(3, 6))

    # The validation pipeline samples with the (untrained) model, classifier-free guidance on.
    vae = spec.load_vae(torch.device("cpu"), torch.float32)
    sampler = spec.build_pipeline(spec.load_denoiser(), vae, encoders)
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
