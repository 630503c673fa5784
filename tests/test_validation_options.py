"""Validation options (``validation_resolution``, ``validation_negative_prompt``, ``validation_seed``,
``validation_guidance_rescale``, ``validation_num_video_frames``, ``ema_validation``): what the config
accepts and refuses per family, and what reaches the real tiny pipelines' ``__call__`` (a recording
wrapper around it), with the images' sizes and file names."""

from __future__ import annotations

import inspect

import pytest
import torch
from PIL import Image

from simpletuner.configuration import validate_config
from simpletuner.configuration.errors import ConfigError
from simpletuner.configuration.rules import GUIDANCE_RESCALE_FAMILIES
from simpletuner.models import get_model_spec
from simpletuner.testing.zoo import write_tiny_model
from simpletuner.training.ema import EMA
from simpletuner.training.validation import generate_validation_images, pipeline_arguments

CPU = torch.device("cpu")


def _hub_config(family: str, **overrides):
    """A config for ``family`` without a model folder (the rules only need the family)."""
    raw = {
        "pretrained_model_name_or_path": "org/some-model",
        "model_family": family,
        "output_dir": "/tmp/validation-options-out",
        "max_train_steps": 1,
        "datasets": [{"id": "a", "type": "local", "instance_data_dir": "/tmp/validation-options-data"}],
        **overrides,
    }
    return validate_config(raw, check_files=False)


def _problems(family: str, **overrides) -> str:
    with pytest.raises(ConfigError) as info:
        _hub_config(family, **overrides)
    return str(info.value)


# --- config ----------------------------------------------------------------------------------


def test_validation_resolution_spellings():
    assert _hub_config("sd", resolution=512).validation_sizes == [(512, 512)]  # unset: resolution, square
    assert _hub_config("sd", validation_resolution=1024).validation_sizes == [(1024, 1024)]
    assert _hub_config("sd", validation_resolution="1024").validation_sizes == [(1024, 1024)]
    assert _hub_config("wan", validation_resolution="832x480").validation_sizes == [(832, 480)]
    sizes = _hub_config("sdxl", validation_resolution=" 1024, 832X480 ,64").validation_sizes
    assert sizes == [(1024, 1024), (832, 480), (64, 64)]
    for bad in ("", "big", "832x", "8x8x8", "1024,,512", "-64"):
        assert "validation_resolution:" in _problems("sd", validation_resolution=bad), bad
    assert "is not a size" in _problems("sd", validation_resolution=True)
    assert "between 1 and 16384" in _problems("sd", validation_resolution="0x64")


def test_validation_resolution_sides_fit_the_family_grid():
    assert _hub_config("sd", validation_resolution="72x64").validation_sizes == [(72, 64)]  # sd: multiples of 8
    problem = _problems("sd", validation_resolution="70x64")
    assert "multiples of 8" in problem and "70 is not" in problem and "use 64x64 or 72x64" in problem
    for family in ("sd3", "flux", "wan"):  # multiples of 16: 8 pixels per latent x 2 latents per token
        problem = _problems(family, validation_resolution="1024, 840x480")
        assert f"model_family '{family}' renders sides that are multiples of 16" in problem
        assert "use 832x480 or 848x480" in problem


def test_guidance_rescale_only_where_the_pipeline_has_it():
    for family in ("sd", "sdxl"):
        assert _hub_config(family, validation_guidance_rescale=0.7).validation_guidance_rescale == 0.7
    for family in ("sd3", "flux", "wan"):
        problem = _problems(family, validation_guidance_rescale=0.7)
        assert f"the {family} pipeline has none: set it to 0 or remove it" in problem
        assert _hub_config(family, validation_guidance_rescale=0).validation_guidance_rescale == 0  # the default
    assert "validation_guidance_rescale:" in _problems("sd", validation_guidance_rescale=-0.1)


def test_video_frames_only_for_video_families():
    assert _hub_config("wan", validation_num_video_frames=9).validation_num_video_frames == 9
    assert "use 5 or 9" in _problems("wan", validation_num_video_frames=7)
    assert _hub_config("sd", validation_num_video_frames=1).validation_num_video_frames == 1
    problem = _problems("flux", validation_num_video_frames=5)
    assert "for video families (wan); model_family 'flux' renders single images" in problem


def test_the_rules_match_the_installed_pipelines():
    """Which installed diffusers pipelines take guidance_rescale / negative_prompt / num_frames."""
    import diffusers

    pipelines = {
        "sd": diffusers.StableDiffusionPipeline,
        "sdxl": diffusers.StableDiffusionXLPipeline,
        "sd3": diffusers.StableDiffusion3Pipeline,
        "flux": diffusers.FluxPipeline,
        "wan": diffusers.WanPipeline,
    }
    for family, cls in pipelines.items():
        params = inspect.signature(cls.__call__).parameters
        assert ("guidance_rescale" in params) == (family in GUIDANCE_RESCALE_FAMILIES), family
        assert "negative_prompt" in params, family
        assert ("num_frames" in params) == (family == "wan"), family


def test_call_arguments_per_family():
    plain = pipeline_arguments("sd", _hub_config("sd"), 64, 64)
    assert plain == {  # an unchanged config makes the call earlier versions made
        "num_images_per_prompt": 1,
        "num_inference_steps": 20,
        "guidance_scale": 7.5,
        "height": 64,
        "width": 64,
    }
    flux = _hub_config("flux", validation_negative_prompt="blurry")
    assert "negative_prompt" not in pipeline_arguments("flux", flux, 64, 64)  # guidance-distilled: none
    wan = _hub_config("wan", validation_negative_prompt="blurry", validation_num_video_frames=5)
    args = pipeline_arguments("wan", wan, 832, 480)
    assert args["negative_prompt"] == "blurry" and args["num_frames"] == 5
    assert (args["width"], args["height"]) == (832, 480)


# --- rendering with the real tiny pipelines --------------------------------------------------


class Recorder:
    """Wraps a real pipeline: every call's keyword arguments are recorded, then the call is made."""

    def __init__(self, pipe):
        self.pipe, self.calls = pipe, []

    def set_progress_bar_config(self, **kwargs):
        self.pipe.set_progress_bar_config(**kwargs)

    def __call__(self, prompt, **kwargs):
        self.calls.append({"prompt": prompt, **kwargs, "seed": kwargs["generator"].initial_seed()})
        return self.pipe(prompt, **kwargs)


def _parts(config):
    spec = get_model_spec(config)
    text = spec.load_text_encoders(CPU, torch.float32)
    vae = spec.load_vae(CPU, torch.float32)
    denoiser = spec.prepare_denoiser(spec.load_denoiser(torch.float32), torch.float32)
    recorders = []
    build = spec.build_pipeline

    def recording_build(*args):
        recorders.append(Recorder(build(*args)))
        return recorders[-1]

    spec.build_pipeline = recording_build
    return spec, denoiser, vae, text, recorders


def test_sd_options_reach_the_pipeline_and_images_have_the_asked_sizes(make_config, tmp_path):
    config = validate_config(
        make_config(
            validation_prompts=["a red circle", "a blue square"],
            num_validation_images=2,
            validation_num_inference_steps=2,
            validation_guidance_scale=3.0,
            validation_resolution="64, 96x64",
            validation_negative_prompt="blurry, ugly",
            validation_seed=7,
            validation_guidance_rescale=0.5,
        )
    )
    spec, denoiser, vae, text, recorders = _parts(config)
    out = tmp_path / "validation"
    paths = generate_validation_images(spec, denoiser, vae, text, config, 3, out)

    calls = recorders[0].calls
    assert [(c["prompt"], c["width"], c["height"]) for c in calls] == [
        ("a red circle", 64, 64),
        ("a blue square", 64, 64),
        ("a red circle", 96, 64),
        ("a blue square", 96, 64),
    ]
    for call in calls:
        assert call["negative_prompt"] == "blurry, ugly"
        assert call["guidance_rescale"] == 0.5 and call["guidance_scale"] == 3.0
        assert call["seed"] == 7 and call["num_images_per_prompt"] == 2 and call["num_inference_steps"] == 2
    names = sorted(p.name for p in paths)
    assert names == sorted(f"step_000003_{w}x64_{k}.png" for w in (64, 96) for k in range(4))
    for path in paths:
        width = int(path.name.split("_")[2].split("x")[0])
        assert Image.open(path).size == (width, 64)
    assert Image.open(out / "step_000003_64x64_grid.png").size == (2 * 64, 2 * 64)
    assert Image.open(out / "step_000003_96x64_grid.png").size == (2 * 96, 2 * 64)


def test_unchanged_config_renders_as_before(make_config, tmp_path):
    config = validate_config(make_config(validation_prompt="a red circle", validation_num_inference_steps=1))
    spec, denoiser, vae, text, recorders = _parts(config)
    paths = generate_validation_images(spec, denoiser, vae, text, config, 0, tmp_path / "v")
    (call,) = recorders[0].calls
    assert set(call) == {
        "prompt",
        "generator",
        "seed",
        "num_images_per_prompt",
        "num_inference_steps",
        "guidance_scale",
        "height",
        "width",
    }
    assert call["seed"] == config.seed and (call["width"], call["height"]) == (64, 64)
    assert [p.name for p in paths] == ["step_000000_0.png"] and (tmp_path / "v" / "step_000000_grid.png").is_file()


def test_ema_validation_comparison_and_ema_only(make_config, tmp_path):
    def render(mode: str, folder: str):
        config = validate_config(
            make_config(
                validation_prompt="a red circle",
                validation_num_inference_steps=1,
                use_ema=True,
                ema_validation=mode,
            )
        )
        spec, denoiser, vae, text, _ = _parts(config)
        ema = EMA.for_model(denoiser, config, CPU)
        with torch.no_grad():  # an average unlike the weights (their LoRA B is 0), the same in every render
            for shadow in ema.state_dict().values():
                shadow.copy_(torch.linspace(-0.5, 0.5, shadow.numel()).reshape(shadow.shape))
        before = [p.detach().clone() for p in ema.params]
        paths = generate_validation_images(spec, denoiser, vae, text, config, 5, tmp_path / folder, ema=ema)
        assert all(torch.equal(a, p) for a, p in zip(before, ema.params))  # the trained weights are back
        return paths

    paths = render("comparison", "cmp")
    assert [p.name for p in paths] == ["step_000005_0.png", "step_000005_0_ema.png"]
    base, averaged = (Image.open(p).convert("RGB") for p in paths)
    assert base.tobytes() != averaged.tobytes()
    grid = Image.open(tmp_path / "cmp" / "step_000005_grid.png").convert("RGB")
    assert grid.size == (2 * 64, 64)  # a row: the trained weights' image, then the EMA's
    assert grid.crop((0, 0, 64, 64)).tobytes() == base.tobytes()
    assert grid.crop((64, 0, 128, 64)).tobytes() == averaged.tobytes()

    (only,) = render("ema_only", "only")
    assert only.name == "step_000005_0.png"
    assert Image.open(only).convert("RGB").tobytes() == averaged.tobytes()
    (plain,) = render("none", "none")
    assert Image.open(plain).convert("RGB").tobytes() == base.tobytes()


def test_wan_renders_the_asked_frames_as_a_video(make_config, tmp_path):
    av = pytest.importorskip("av")  # the .mp4 beside the PNG needs PyAV (without it: .webp, tested elsewhere)
    model = write_tiny_model("wan", tmp_path / "wan")
    config = validate_config(
        make_config(
            pretrained_model_name_or_path=str(model),
            model_family="wan",
            resolution=32,
            validation_prompt="a red square",
            validation_num_inference_steps=1,
            validation_num_video_frames=5,
            validation_resolution="48x32",
            validation_negative_prompt="static",
        )
    )
    spec, denoiser, vae, text, recorders = _parts(config)
    (png,) = generate_validation_images(spec, denoiser, vae, text, config, 1, tmp_path / "v")
    (call,) = recorders[0].calls
    assert call["num_frames"] == 5 and call["negative_prompt"] == "static"
    assert Image.open(png).size == (48, 32)
    with av.open(str(png.with_suffix(".mp4"))) as clip:  # the whole clip beside the PNG (PyAV is installed)
        frames = list(clip.decode(clip.streams.video[0]))
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (48, 32)
