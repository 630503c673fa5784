"""Wan 2.2 image-to-video A14B (two experts, first-frame condition) and TI2V-5B (per-token timesteps)
on their tiny zoo models: variant choice from the folder, the condition built as the diffusers
pipelines build it, the losses by hand, LoRA training through the Trainer reloaded in the pipelines,
too-short clips named before training, the memory estimate."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from training_helpers import train

from simpletuner.configuration import validate_config
from simpletuner.models import Wan22I2VSpec, Wan22Spec, Wan22TI2VSpec, get_model_spec
from simpletuner.models.wan import WAN_MAX_LENGTH
from simpletuner.models.wan22 import LORA_FILES
from simpletuner.testing.zoo import TINY_WAN_LATENT_CHANNELS as C
from simpletuner.testing.zoo import TINY_WAN_T5_WIDTH as WIDTH

MEAN = torch.tensor([0.1, -0.2, 0.3, -0.05]).view(1, C, 1, 1, 1)  # the zoo VAE's latents_mean / latents_std
STD = torch.tensor([1.5, 0.8, 2.0, 1.2]).view(1, C, 1, 1, 1)


@pytest.fixture(scope="module")
def tiny_i2v(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    return write_tiny_model("wan22_i2v", tmp_path_factory.mktemp("tiny_wan22_i2v") / "model")


@pytest.fixture(scope="module")
def tiny_ti2v(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    return write_tiny_model("wan22_ti2v", tmp_path_factory.mktemp("tiny_wan22_ti2v") / "model")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Four 5-frame clips (frame folders, 64x64, moving gradients) with captions."""
    root = tmp_path_factory.mktemp("clips")
    ys, xs = np.mgrid[0:64, 0:64].astype(np.float32)
    for c in range(4):
        folder = root / f"clip{c}"
        folder.mkdir()
        for i in range(5):
            array = np.stack([xs * 3 + 20 * i, ys * 3 + 40 * c, (xs + ys) * 1.5], axis=-1)
            Image.fromarray(array.clip(0, 255).astype(np.uint8)).save(folder / f"f{i + 1}.png")
        (root / f"clip{c}.txt").write_text(f"clip number {c}")
    return root


def _config(make_config, model, tmp_path, clips=None, **overrides):
    datasets = []
    if clips is not None:
        datasets = [
            {
                "id": "clips",
                "type": "local",
                "instance_data_dir": str(clips),
                "dataset_type": "video",
                "num_frames": 5,
                "caption_strategy": "textfile",
            }
        ]
        overrides.setdefault("datasets", datasets)
    return make_config(
        **{
            "pretrained_model_name_or_path": str(model),
            "model_family": "wan",
            "output_dir": str(tmp_path / "out"),
            "aspect_bucket_alignment": 32,  # TI2V: /16 VAE x 2x2 patches
            **overrides,
        }
    )


def test_the_folder_picks_the_variant(make_config, tiny_i2v, tiny_ti2v, tmp_path):
    i2v = get_model_spec(validate_config(_config(make_config, tiny_i2v, tmp_path)))
    assert type(i2v) is Wan22I2VSpec and i2v.boundary_ratio == 0.9 and i2v.stages == ("high", "low")
    ti2v = get_model_spec(validate_config(_config(make_config, tiny_ti2v, tmp_path)))
    assert type(ti2v) is Wan22TI2VSpec and not ti2v.first_frame
    assert ti2v.vae_scale_from_folder() == 16  # the Wan 2.2 VAE: /16 spatially
    assert get_model_spec(validate_config(_config(make_config, tiny_i2v, tmp_path, train_stages="low"))).stages == (
        "low",
    )
    with pytest.raises(ValueError, match="ti2v_first_frame.*not a Wan 2.2 TI2V-5B folder"):
        get_model_spec(validate_config(_config(make_config, tiny_i2v, tmp_path, ti2v_first_frame=True)))
    # A one-transformer image-to-video folder is Wan 2.1 I2V: refused, named.
    wan21_i2v = tmp_path / "wan21_i2v"
    shutil.copytree(tiny_i2v, wan21_i2v)
    index = json.loads((wan21_i2v / "model_index.json").read_text())
    index.update(transformer_2=[None, None], boundary_ratio=None)
    (wan21_i2v / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="Wan 2.1 I2V.*not supported"):
        get_model_spec(validate_config(_config(make_config, wan21_i2v, tmp_path)))
    # A T2V A14B folder keeps its spec.
    index.update(_class_name="WanPipeline", transformer_2=index["transformer"], boundary_ratio=0.875)
    (wan21_i2v / "model_index.json").write_text(json.dumps(index))
    assert type(get_model_spec(validate_config(_config(make_config, wan21_i2v, tmp_path)))) is Wan22Spec


def test_i2v_condition_is_the_pipelines_and_the_loss_is_by_hand(make_config, tiny_i2v, tmp_path):
    from diffusers import WanImageToVideoPipeline

    spec = get_model_spec(validate_config(_config(make_config, tiny_i2v, tmp_path)))
    vae = spec.load_vae(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 5, 64, 64, generator=gen) * 2 - 1
    cached = spec.encode_images(vae, pixels)
    assert cached.shape == (2, 2 * C, 2, 8, 8)
    clip, condition = spec.split_latents(cached)
    with torch.no_grad():
        assert torch.allclose(clip, (vae.encode(pixels).latent_dist.mode() - MEAN) / STD, atol=1e-6)
        # The pipeline's own condition for the first frame of each clip: [mask (4 channels), latents].
        pipe = WanImageToVideoPipeline.from_pretrained(str(tiny_i2v), use_safetensors=True)
        for b in range(2):
            _, want = pipe.prepare_latents(
                pixels[b : b + 1, :, 0], 1, C, 64, 64, 5, torch.float32, torch.device("cpu"), generator=None
            )
            assert want.shape == (1, 4 + C, 2, 8, 8)
            assert torch.allclose(spec.condition_input(condition[b : b + 1]), want, atol=1e-5)
        # Not a slice of the clip's latents: the zero frames change the condition's later frames.
        assert not torch.allclose(condition[:, :, 1:], clip[:, :, 1:], atol=1e-3)

        denoiser = spec.load_denoiser().eval()
        embeds = torch.randn(2, WAN_MAX_LENGTH, WIDTH, generator=gen)
        got = spec.training_loss(denoiser, cached, {"prompt_embeds": embeds}, torch.Generator().manual_seed(3))
        g = torch.Generator().manual_seed(3)
        noise = torch.randn(clip.shape, generator=g)
        sigmas = spec.sample_sigmas(2, g)
        s = sigmas.view(-1, 1, 1, 1, 1)
        mask = torch.zeros(2, 4, 2, 8, 8)
        mask[:, :, 0] = 1
        hidden = torch.cat([(1 - s) * clip + s * noise, mask, condition], dim=1)
        want = []
        for b in range(2):
            t = sigmas[b : b + 1] * 1000
            expert = denoiser.transformer if t.item() >= 900 else denoiser.transformer_2
            pred = expert(
                hidden_states=hidden[b : b + 1], timestep=t, encoder_hidden_states=embeds[b : b + 1], return_dict=False
            )[0]
            want.append(((pred - (noise[b : b + 1] - clip[b : b + 1])) ** 2).mean())
    assert torch.allclose(got, torch.stack(want), atol=1e-6, rtol=1e-5)


def test_ti2v_losses_by_hand_as_the_pipelines_run_it(make_config, tiny_ti2v, tmp_path):
    text = get_model_spec(validate_config(_config(make_config, tiny_ti2v, tmp_path)))
    image = get_model_spec(validate_config(_config(make_config, tiny_ti2v, tmp_path, ti2v_first_frame=True)))
    vae = text.load_vae(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    pixels = torch.rand(2, 3, 9, 64, 64, generator=gen) * 2 - 1
    with torch.no_grad():
        latents = text.encode_images(vae, pixels)
        assert latents.shape == (2, C, 3, 4, 4)
        # The image-to-video pipeline encodes the image alone: with the causal VAE that is latent frame 0.
        alone = text.encode_images(vae, pixels[:, :, 0])
        assert torch.equal(alone[:, :, 0], latents[:, :, 0])

        model = text.load_denoiser().eval()
        embeds = torch.randn(2, WAN_MAX_LENGTH, WIDTH, generator=gen)
        cond = {"prompt_embeds": embeds}
        g = torch.Generator().manual_seed(5)
        noise = torch.randn(latents.shape, generator=g)
        sigmas = text.sample_sigmas(2, g)
        s = sigmas.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        t = sigmas * 1000

        # Text-to-video: WanPipeline's per-token timesteps (all equal) give the per-sample form's output.
        per_token = t[:, None].expand(-1, 3 * 2 * 2)
        pred = model(hidden_states=noisy, timestep=per_token, encoder_hidden_states=embeds, return_dict=False)[0]
        want = ((pred - (noise - latents)) ** 2).mean(dim=(1, 2, 3, 4))
        got = text.training_loss(model, latents, cond, torch.Generator().manual_seed(5))
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)

        # Image-to-video: the pipeline's (1 - mask) * condition + mask * latents, and mask[:, ::2, ::2] * t.
        mask = torch.ones(1, 1, 3, 4, 4)
        mask[:, :, 0] = 0
        hidden = (1 - mask) * latents + mask * noisy
        timestep = (mask[0][0][:, ::2, ::2][None] * t.view(-1, 1, 1, 1)).flatten(1)
        pred = model(hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds, return_dict=False)[0]
        want = ((pred - (noise - latents))[:, :, 1:] ** 2).mean(dim=(1, 2, 3, 4))  # frame 0 is the given image
        got = image.training_loss(model, latents, cond, torch.Generator().manual_seed(5))
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
        # One latent frame (an image): nothing left to generate, it trains text-to-video.
        one = latents[:, :, :1]
        assert torch.equal(
            image.training_loss(model, one, cond, torch.Generator().manual_seed(2)),
            text.training_loss(model, one, cond, torch.Generator().manual_seed(2)),
        )


def _inputs(channels: int, size: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(2, channels, 2, size, size, generator=gen),
        encoder_hidden_states=torch.randn(2, WAN_MAX_LENGTH, WIDTH, generator=gen),
    )


def test_i2v_trains_both_experts_and_reloads_in_the_pipeline(make_config, tiny_i2v, clips, tmp_path):
    from diffusers import WanImageToVideoPipeline

    raw = _config(
        make_config, tiny_i2v, tmp_path, clips, max_train_steps=3, learning_rate=1e-2, lora_rank=4, train_batch_size=2
    )
    trainer, result = train(raw)
    out = result.output_path.parent
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(LORA_FILES.values())
    pipe = WanImageToVideoPipeline.from_pretrained(str(tiny_i2v), use_safetensors=True)
    pipe.load_lora_weights(str(out), weight_name=LORA_FILES["high"], adapter_name="high")
    pipe.load_lora_weights(str(out), weight_name=LORA_FILES["low"], adapter_name="low", load_into_transformer_2=True)
    base = WanImageToVideoPipeline.from_pretrained(str(tiny_i2v), use_safetensors=True)
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    inputs = _inputs(2 * C + 4, 8)
    timestep = torch.tensor([950.0, 300.0])
    with torch.no_grad():
        want = trained(timestep=timestep, **inputs)[0]
        for i, (loaded, untouched) in enumerate(
            ((pipe.transformer, base.transformer), (pipe.transformer_2, base.transformer_2))
        ):
            got = loaded(timestep=timestep, **inputs, return_dict=False)[0]
            assert torch.allclose(got[i], want[i], atol=1e-5)
            assert not torch.allclose(
                untouched(timestep=timestep, **inputs, return_dict=False)[0][i], want[i], atol=1e-4
            )


def test_ti2v_trains_and_reloads_in_the_pipeline(make_config, tiny_ti2v, clips, tmp_path):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    raw = _config(
        make_config,
        tiny_ti2v,
        tmp_path,
        clips,
        max_train_steps=3,
        learning_rate=1e-2,
        lora_rank=4,
        train_batch_size=2,
        ti2v_first_frame=True,
    )
    trainer, result = train(raw)
    pipe = WanPipeline.from_pretrained(str(tiny_ti2v), use_safetensors=True)
    assert pipe.config.expand_timesteps
    pipe.load_lora_weights(str(result.output_path))
    i2v = WanImageToVideoPipeline.from_pretrained(str(tiny_ti2v), use_safetensors=True)  # the image mode's pipeline
    i2v.load_lora_weights(str(result.output_path))
    base = WanPipeline.from_pretrained(str(tiny_ti2v), use_safetensors=True)
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    inputs = _inputs(C, 4)
    timestep = torch.tensor([[0.0] * 4 + [700.0] * 4, [0.0] * 4 + [200.0] * 4])
    with torch.no_grad():
        want = trained(timestep=timestep, **inputs, return_dict=False)[0]
        for loaded in (pipe.transformer, i2v.transformer):
            assert torch.allclose(loaded(timestep=timestep, **inputs, return_dict=False)[0], want, atol=1e-5)
        assert not torch.allclose(base.transformer(timestep=timestep, **inputs, return_dict=False)[0], want, atol=1e-4)


def test_a_clip_too_short_for_num_frames_is_named_before_training(make_config, tiny_i2v, clips, tmp_path):
    from simpletuner.state import StateTracker
    from simpletuner.training.trainer import Trainer

    data = tmp_path / "clips"
    shutil.copytree(clips, data)
    shutil.rmtree(data / "clip2")
    (data / "clip2").mkdir()
    for i in range(3):
        shutil.copy(clips / "clip2" / f"f{i + 1}.png", data / "clip2" / f"f{i + 1}.png")
    raw = _config(make_config, tiny_i2v, tmp_path, data)
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    with pytest.raises(ValueError) as caught:
        trainer.train()
    assert trainer.progress.global_step == 0
    message = str(caught.value)
    assert "clip2/: 3 frame(s)" in message and "5 frames" in message and "num_frames=5 at frame_stride=1" in message


def test_memory_estimate_covers_both(make_config, tiny_i2v, tiny_ti2v, clips, tmp_path):
    from simpletuner.memory.estimator import batch_shapes, estimate_memory

    i2v = validate_config(_config(make_config, tiny_i2v, tmp_path, clips, mixed_precision="no"))
    latents, _ = batch_shapes(i2v, 2)
    assert latents.shape == (2, 2 * C, 2, 8, 8)  # clip + condition latents, as cached
    both = estimate_memory(i2v, device_kind="cpu")
    one = estimate_memory(
        validate_config(_config(make_config, tiny_i2v, tmp_path, clips, mixed_precision="no", train_stages="high")),
        device_kind="cpu",
    )
    assert both.trainable_weights == 2 * one.trainable_weights > 0
    ti2v = validate_config(_config(make_config, tiny_ti2v, tmp_path, clips, mixed_precision="no"))
    latents, _ = batch_shapes(ti2v, 2)
    assert latents.shape == (2, C, 2, 4, 4)  # /16 spatially
    assert estimate_memory(ti2v, device_kind="cpu").trainable_weights > 0


@pytest.mark.parametrize("variant", ["i2v", "ti2v_first_frame", "ti2v"])
def test_validation_renders_videos(variant, make_config, tiny_i2v, tiny_ti2v, tmp_path):
    model = tiny_i2v if variant == "i2v" else tiny_ti2v
    cfg = _config(make_config, model, tmp_path, ti2v_first_frame=variant == "ti2v_first_frame")
    spec = get_model_spec(validate_config(cfg))
    cpu = torch.device("cpu")
    denoiser = spec.load_denoiser()
    sampler = spec.build_pipeline(
        denoiser, spec.load_vae(cpu, torch.float32), spec.load_text_encoders(cpu, torch.float32)
    )
    assert type(sampler.pipe).__name__ == ("WanPipeline" if variant == "ti2v" else "WanImageToVideoPipeline")
    assert sampler.pipe.config.expand_timesteps == (variant != "i2v")
    sampler.set_progress_bar_config(disable=True)
    out = sampler(
        "a red square",
        num_frames=5,
        num_inference_steps=2,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
    )
    assert len(out.frames) == 1 and len(out.frames[0]) == 5 and out.images[0].size == (64, 64)


def test_ti2v_first_frame_needs_the_wan_family(make_config):
    from simpletuner.configuration.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="ti2v_first_frame.*model_family is 'sd'"):
        validate_config(make_config(ti2v_first_frame=True))


def test_validation_image_is_the_first_frame(make_config, tiny_i2v, tiny_ti2v, tmp_path):
    from PIL import Image

    from simpletuner.training.validation import validation_images

    red = tmp_path / "red.png"
    Image.new("RGB", (64, 64), (220, 30, 30)).save(red)
    takes = {}
    for name, model, first in [
        ("i2v", tiny_i2v, False),
        ("ti2v_first_frame", tiny_ti2v, True),
        ("ti2v", tiny_ti2v, False),
    ]:
        raw = _config(make_config, model, tmp_path, ti2v_first_frame=first, validation_prompts=["a", "b"])
        takes[name] = get_model_spec(validate_config(raw)).takes_validation_image
    assert takes == {"i2v": True, "ti2v_first_frame": True, "ti2v": False}

    cfg = validate_config(
        _config(make_config, tiny_i2v, tmp_path, validation_prompts=["a", "b"], validation_image=str(red))
    )
    spec = get_model_spec(cfg)
    images = validation_images(spec, cfg)
    assert len(images) == 2 and all(img.getpixel((5, 5)) == (220, 30, 30) for img in images)
    assert validation_images(spec, validate_config(_config(make_config, tiny_i2v, tmp_path))) is None  # grey frame

    cpu = torch.device("cpu")
    sampler = spec.build_pipeline(
        spec.load_denoiser(), spec.load_vae(cpu, torch.float32), spec.load_text_encoders(cpu, torch.float32)
    )
    sampler.set_progress_bar_config(disable=True)
    args = dict(num_frames=5, num_inference_steps=2, height=64, width=64)
    grey = sampler("a", generator=torch.Generator().manual_seed(0), **args).frames[0]
    from_red = sampler("a", image=images[0], generator=torch.Generator().manual_seed(0), **args).frames[0]
    import numpy as np

    diff = sum(
        np.abs(np.asarray(a, dtype=np.int32) - np.asarray(b, dtype=np.int32)).sum() for a, b in zip(grey, from_red)
    )
    assert diff > 0, "the first frame must condition the video"
