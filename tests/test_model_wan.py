"""The wan family (Wan 2.1 T2V, single transformer) on its tiny zoo model: images as 1-frame video
latents, prompt encoding as WanPipeline does it, the flow-matching loss by hand, validation
sampling, the estimate of a video dataset. LoRA training, reload in diffusers and the image
estimate: test_families.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from simpletuner.configuration import validate_config
from simpletuner.models import WanSpec, get_model_spec
from simpletuner.models import noise as noise_lib
from simpletuner.models.wan import WAN_MAX_LENGTH
from simpletuner.testing.zoo import TINY_WAN_LATENT_CHANNELS as C
from simpletuner.testing.zoo import TINY_WAN_T5_WIDTH as WIDTH


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    return write_tiny_model("wan", tmp_path_factory.mktemp("tiny_wan") / "model")


@pytest.fixture
def wan_config(make_config, tiny_wan):
    def _make(**overrides):
        return make_config(**{"pretrained_model_name_or_path": str(tiny_wan), "model_family": "wan", **overrides})

    return _make


def test_zoo_loads_and_images_become_one_frame_latents(wan_config, tiny_wan, tmp_path):
    spec = get_model_spec(validate_config(wan_config()))
    assert isinstance(spec, WanSpec) and spec.shift == 3.0  # the UniPC scheduler's flow_shift
    assert get_model_spec(validate_config(wan_config(flow_shift=5.0))).shift == 5.0
    transformer = spec.load_denoiser()
    assert type(transformer).__name__ == "WanTransformer3DModel" and transformer.config.in_channels == C
    vae = spec.load_vae(torch.device("cpu"), torch.float32)
    pixels = torch.rand(2, 3, 64, 64) * 2 - 1
    got = spec.encode_images(vae, pixels)
    assert got.shape == (2, C, 1, 8, 8)
    raw = vae.encode(pixels.unsqueeze(2)).latent_dist.mode()
    mean = torch.tensor([0.1, -0.2, 0.3, -0.05]).view(1, C, 1, 1, 1)
    std = torch.tensor([1.5, 0.8, 2.0, 1.2]).view(1, C, 1, 1, 1)
    assert torch.allclose(got, (raw - mean) / std, atol=1e-6)
    # WanPipeline's decode step (latents / (1 / std) + mean) inverts it.
    assert torch.allclose(got / (1.0 / std) + mean, raw, atol=1e-5)

    bad = tmp_path / "bad"
    shutil.copytree(tiny_wan, bad)
    index = json.loads((bad / "model_index.json").read_text())
    index["text_encoder"] = ["transformers", "CLIPTextModel"]
    (bad / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="text_encoder.*UMT5EncoderModel"):
        get_model_spec(validate_config(wan_config(pretrained_model_name_or_path=str(bad))))


def test_prompts_match_wan_pipeline_and_validation_samples(wan_config, tiny_wan):
    from diffusers import WanPipeline

    spec = get_model_spec(validate_config(wan_config()))
    encoders = spec.load_text_encoders(torch.device("cpu"), torch.float32)
    captions = ["a red  square ", "a blue circle on grey, with a long caption"]
    out = spec.encode_prompts(encoders, captions)
    assert all(c["prompt_embeds"].shape == (WAN_MAX_LENGTH, WIDTH) for c in out)
    pipe = WanPipeline.from_pretrained(str(tiny_wan), use_safetensors=True)
    with torch.no_grad():
        want, _ = pipe.encode_prompt(
            captions, do_classifier_free_guidance=False, max_sequence_length=WAN_MAX_LENGTH, device="cpu"
        )
    got = torch.stack([c["prompt_embeds"] for c in out])
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.count_nonzero(got[0, 20:]) == 0 and torch.count_nonzero(got[0, :5]) > 0  # zero padding

    sampler = spec.build_pipeline(spec.load_denoiser(), spec.load_vae(torch.device("cpu"), torch.float32), encoders)
    sampler.set_progress_bar_config(disable=True)
    images = sampler(
        "a red square",
        num_images_per_prompt=2,
        num_inference_steps=2,
        guidance_scale=3.0,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
    ).images
    assert len(images) == 2 and images[0].size == (64, 64)


@pytest.mark.parametrize("weighting", ["none", "cosmap"])
def test_loss_is_the_flow_matching_formula(wan_config, weighting):
    spec = get_model_spec(
        validate_config(
            wan_config(timestep_sampling="logit_normal", logit_mean=0.2, flow_shift=2.0, loss_weighting=weighting)
        )
    )
    model = spec.load_denoiser().eval()
    gen = torch.Generator().manual_seed(7)
    latents = torch.randn(3, C, 1, 8, 8, generator=gen)
    cond = {"prompt_embeds": torch.randn(3, WAN_MAX_LENGTH, WIDTH, generator=gen)}
    with torch.no_grad():
        got = spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))
        g = torch.Generator().manual_seed(3)
        noise = torch.randn(latents.shape, generator=g)
        u = torch.sigmoid(torch.randn(3, generator=g) - 0.2)  # logit_mean: diffusers' sign
        sigmas = 2.0 * u / (1 + u)
        s = sigmas.view(-1, 1, 1, 1, 1)
        pred = model(
            hidden_states=(1 - s) * latents + s * noise,
            timestep=sigmas * 1000,
            encoder_hidden_states=cond["prompt_embeds"],
            return_dict=False,
        )[0]
        want = ((pred - (noise - latents)) ** 2).mean(dim=(1, 2, 3, 4))
        if weighting != "none":
            want = want * noise_lib.flow_weights(sigmas, weighting)
    assert got.shape == (3,) and torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_memory_estimate_of_a_video_dataset_counts_its_frames(wan_config, tmp_path):
    from simpletuner.memory.estimator import batch_shapes

    (tmp_path / "clips").mkdir()  # beside output_dir, not holding it
    video = {
        "id": "clips",
        "type": "local",
        "instance_data_dir": str(tmp_path / "clips"),
        "dataset_type": "video",
        "num_frames": 9,
    }
    cfg = validate_config(wan_config(datasets=[video]))
    latents, _ = batch_shapes(cfg, 2)
    assert latents.shape == (2, C, 3, 8, 8)  # 9 frames -> (9 - 1) / 4 + 1 latent frames
