"""ControlNet training (``controlnet: true``) for SDXL and Flux on their tiny zoo models: the conditioning image
reaches the ControlNet and its residuals the frozen base; a fresh ControlNet (from_unet / from_transformer) gives
the base's own loss at step 0; full and LoRA runs write what diffusers' ControlNet pipelines load and render with;
validation renders with the control image; pairing errors stop before caching; resume; the refusals; SimpleTuner's
ControlNet config shape through the dialect."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from training_helpers import config_problems, train

from simpletuner.configuration import validate_config
from simpletuner.models import get_model_spec
from simpletuner.models.controlnet import CONTROLNET_FOLDER, LORA_FILE, LORA_PREFIX, ControlledDenoiser

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Four 64 px images, each with a conditioning image of the same name (the edit-pair demo's shapes)."""
    from simpletuner.testing.demo_data import write_edit_pairs

    return write_edit_pairs(tmp_path_factory.mktemp("controlnet_pairs"), num_pairs=4, sizes=((64, 64),))


def _datasets(pairs) -> list[dict]:
    images, sources = pairs
    return [{"id": "pairs", "type": "local", "instance_data_dir": str(images), "conditioning_data_dir": str(sources)}]


def _controlnet_config(zoo_config, pairs, family: str):
    """``family``'s tiny model training a full ControlNet for one step on the pairs; keyword overrides replace keys."""

    def make(**overrides):
        raw = zoo_config(
            family,
            controlnet=True,
            training_type="full",
            datasets=_datasets(pairs),
            max_train_steps=1,
            learning_rate=1e-3,
            mixed_precision="no",
        )
        raw.update(overrides)
        return raw

    return make


@pytest.fixture
def sdxl_config(zoo_config, pairs):
    return _controlnet_config(zoo_config, pairs, "sdxl")


def _sdxl_batch(seed: int = 0, side: int = 32):
    from simpletuner.models.sdxl_controlnet import CONTROL_PIXELS
    from simpletuner.testing.zoo import TINY_SDXL_HIDDEN, TINY_SDXL_PROJECTION

    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 4, side // 8, side // 8, generator=g)
    cond = {
        "prompt_embeds": torch.randn(2, 77, sum(TINY_SDXL_HIDDEN), generator=g),
        "pooled_prompt_embeds": torch.randn(2, TINY_SDXL_PROJECTION, generator=g),
        CONTROL_PIXELS: torch.randint(0, 256, (2, 3, side, side), generator=g, dtype=torch.uint8),
    }
    return latents, cond


# --- SDXL ----------------------------------------------------------------------------------------------------------


def test_sdxl_step0_is_the_base_loss_and_the_control_image_reaches_the_unet(sdxl_config):
    from simpletuner.models.sdxl_controlnet import CONTROL_PIXELS, StableDiffusionXLControlNetSpec

    spec = get_model_spec(validate_config(sdxl_config()))
    assert type(spec) is StableDiffusionXLControlNetSpec and spec.conditions_on_image
    model = spec.prepare_denoiser(spec.load_denoiser(), torch.float32)
    assert isinstance(model, ControlledDenoiser)
    assert not any(p.requires_grad for p in model.base.parameters())
    assert all(p.requires_grad for p in model.controlnet.parameters())
    latents, cond = _sdxl_batch()
    plain = get_model_spec(validate_config(sdxl_config(controlnet=False)))
    with torch.no_grad():
        got = spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))
        base = plain.training_loss(model.base, latents, cond, torch.Generator().manual_seed(3))
    assert torch.equal(got, base)  # zero convolutions: a fresh ControlNet adds nothing
    trained = (model.controlnet.controlnet_down_blocks, model.controlnet.controlnet_cond_embedding.conv_out)
    for p in (p for part in trained for p in part.parameters()):  # zero-initialised: as after some training
        p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    other = {**cond, CONTROL_PIXELS: 255 - cond[CONTROL_PIXELS]}
    loss = spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))
    with torch.no_grad():
        changed = spec.training_loss(model, latents, other, torch.Generator().manual_seed(3))
    assert (loss - changed).abs().max() > 1e-4, (loss, changed)  # the conditioning image reaches the ControlNet
    loss.sum().backward()
    assert model.controlnet.controlnet_cond_embedding.conv_in.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.base.parameters())  # the base stays frozen


def _render_sdxl(model_folder: Path, controlnet, control: Image.Image):
    from diffusers import StableDiffusionXLControlNetPipeline

    pipe = StableDiffusionXLControlNetPipeline.from_pretrained(
        str(model_folder), controlnet=controlnet, use_safetensors=True, add_watermarker=False
    )
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        "a circle",
        image=control,
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )
    return out.images


@pytest.fixture(scope="module")
def sdxl_full_run(zoo, pairs, tmp_path_factory):
    """One full ControlNet step with validation from `validation_image` and a checkpoint."""
    from training_helpers import tiny_config

    root = tmp_path_factory.mktemp("sdxl_controlnet_full")
    raw = tiny_config(
        zoo("sdxl"),
        pairs[0],
        root,
        model_family="sdxl",
        controlnet=True,
        training_type="full",
        datasets=_datasets(pairs),
        max_train_steps=2,
        checkpointing_steps=1,
        learning_rate=1e-3,
        mixed_precision="no",
        validation_prompt="a circle",
        validation_image=str(pairs[1] / "000.png"),
        validation_num_inference_steps=1,
        validation_steps=2,
    )
    return raw, *train(raw)


def test_sdxl_full_run_saves_the_controlnet_folder_the_pipeline_renders_with(sdxl_full_run, zoo, pairs):
    from diffusers import ControlNetModel

    raw, trainer, result = sdxl_full_run
    assert result.global_step == 2 and all(math.isfinite(x) for x in result.losses)
    out = Path(raw["output_dir"])
    folder = out / CONTROLNET_FOLDER
    assert result.output_path == folder and (folder / "config.json").is_file()
    assert not (out / "unet").exists()  # the base is not written
    loaded = ControlNetModel.from_pretrained(str(folder), use_safetensors=True)
    trained = trainer.accelerator.unwrap_model(trainer.model).controlnet
    for name, value in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    fresh = get_model_spec(validate_config(raw)).load_denoiser().controlnet
    assert not torch.equal(fresh.controlnet_mid_block.weight, loaded.controlnet_mid_block.weight)  # it trained
    control = Image.open(pairs[1] / "000.png").convert("RGB")
    image = _render_sdxl(zoo("sdxl"), loaded, control)
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()
    # A checkpoint holds the ControlNet folder too.
    checkpoint = sorted(out.glob("checkpoint-*"))[0]
    assert (checkpoint / CONTROLNET_FOLDER / "config.json").is_file()


def test_sdxl_validation_renders_with_the_control_image(sdxl_full_run, pairs):
    _, trainer, result = sdxl_full_run
    assert sorted(p.name for p in result.validation_images) == ["step_000000_0.png", "step_000002_0.png"]
    assert Image.open(result.validation_images[-1]).size == (64, 64)
    # The validator renders from validation_image (the second pair's image here, not the first pair's control).
    control = Image.open(pairs[1] / "000.png").convert("RGB")
    assert [list(i.getdata()) for i in trainer.validator.images] == [list(control.getdata())]
    spec, model = trainer.spec, trainer.accelerator.unwrap_model(trainer.model)
    sampler = spec.build_pipeline(model, trainer.validator.vae, trainer.validator.text_encoders)
    sampler.set_progress_bar_config(disable=True)

    def render(image):
        args = dict(height=64, width=64, num_inference_steps=1, output_type="pt")
        return sampler("a circle", image=image, generator=torch.Generator().manual_seed(0), **args).images

    assert not torch.allclose(render(control), render(control.transpose(Image.Transpose.FLIP_LEFT_RIGHT)))


def test_sdxl_trains_on_a_hub_controlnet_from_the_hub_cache(sdxl_full_run, sdxl_config, tmp_path, monkeypatch):
    from hub_fixtures import folder_files, lay_out_hub_cache, use_hub_cache

    from simpletuner.cli.train import main as train_main

    raw, _, _ = sdxl_full_run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = use_hub_cache(monkeypatch, tmp_path / "hub")
    repo = "tiny-org/tiny-controlnet"
    commit = lay_out_hub_cache(hub, repo, folder_files(Path(raw["output_dir"]) / CONTROLNET_FOLDER))
    config = tmp_path / "cfg.json"
    out = tmp_path / "out"
    cfg = sdxl_config(controlnet_model_name_or_path=repo, output_dir=str(out), checkpointing_steps=1)
    config.write_text(json.dumps(cfg))
    assert train_main(["--config", str(config)]) == 0
    snapshot = hub / "models--tiny-org--tiny-controlnet" / "snapshots" / commit
    assert (
        f"controlnet_model_name_or_path '{repo}' (revision main): the Hub snapshot"
        in (out / "training.log").read_text()
    )
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["identity"]["hub_controlnet"] == f"{repo}@{commit}" and state["identity"]["controlnet"] is True
    assert json.loads((out / "config.json").read_text())["controlnet_model_name_or_path"] == repo
    assert (snapshot / "diffusion_pytorch_model.safetensors").exists()


def test_sdxl_lora_run_writes_the_adapter_and_the_merged_controlnet(zoo, pairs, sdxl_config, tmp_path):
    from diffusers import ControlNetModel

    raw = sdxl_config(training_type="lora", lora_rank=4, learning_rate=5e-2, output_dir=str(tmp_path / "out"))
    trainer, result = train(raw)
    out = Path(raw["output_dir"])
    assert result.output_path == out / LORA_FILE
    from safetensors import safe_open

    with safe_open(str(out / LORA_FILE), "pt") as handle:
        keys = list(handle.keys())
    assert keys and all(k.startswith(LORA_PREFIX + ".") and ".lora_" in k for k in keys)
    assert any("controlnet_down_blocks" in k for k in keys) and any("conv_in" in k for k in keys)
    trained = trainer.accelerator.unwrap_model(trainer.model).controlnet.eval()
    latents, cond = _sdxl_batch(5, 64)
    from simpletuner.models.sdxl_controlnet import CONTROL_PIXELS

    inputs = (latents, torch.tensor([10, 500]), cond["prompt_embeds"])
    kwargs = dict(
        added_cond_kwargs={"text_embeds": cond["pooled_prompt_embeds"], "time_ids": torch.ones(2, 6)},
        controlnet_cond=cond[CONTROL_PIXELS].float() / 255,
        return_dict=False,
    )
    with torch.no_grad():
        want = trained(*inputs, **kwargs)
        # The merged folder, as a plain ControlNet.
        merged = ControlNetModel.from_pretrained(str(out / CONTROLNET_FOLDER), use_safetensors=True).eval()
        for a, b in zip(merged(*inputs, **kwargs)[0], want[0]):
            assert torch.allclose(a, b, atol=1e-5)
        # The adapter file on the ControlNet it was trained on (the fresh one from_unet under the seed).
        base = get_model_spec(validate_config(raw)).load_denoiser().controlnet.eval()
        untrained = base(*inputs, **kwargs)
        base.load_lora_adapter(str(out / LORA_FILE), prefix=LORA_PREFIX)
        for a, b in zip(base(*inputs, **kwargs)[0], want[0]):
            assert torch.allclose(a, b, atol=1e-5)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(untrained[0], want[0]))  # the LoRA trained
    image = _render_sdxl(zoo("sdxl"), merged, Image.open(pairs[1] / "000.png").convert("RGB"))
    assert image.shape == (1, 3, 64, 64)


def test_sdxl_resume_continues_the_controlnet(sdxl_config, tmp_path):
    from training_helpers import straight_and_resumed

    (a, _), (b, _) = straight_and_resumed(sdxl_config, tmp_path, steps=2, resume_at=1)
    for (name, x), (_, y) in zip(
        a.accelerator.unwrap_model(a.model).controlnet.state_dict().items(),
        b.accelerator.unwrap_model(b.model).controlnet.state_dict().items(),
    ):
        assert torch.allclose(x, y, atol=1e-6), name


def test_a_missing_conditioning_image_stops_before_caching(sdxl_config, pairs, tmp_path):
    import shutil

    images, sources = pairs
    partial = tmp_path / "sources"
    shutil.copytree(sources, partial)
    (partial / "002.png").unlink()
    raw = sdxl_config(
        datasets=[
            {"id": "pairs", "type": "local", "instance_data_dir": str(images), "conditioning_data_dir": str(partial)}
        ],
        output_dir=str(tmp_path / "out"),
        cache_config={"cache_dir": str(tmp_path / "cache")},
    )
    with pytest.raises(ValueError, match=r"have no source image in .*: 002\.png"):
        train(raw)
    assert not any((tmp_path / "cache").rglob("*.safetensors"))  # nothing was cached


# --- Flux ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def flux_config(zoo_config, pairs):
    return _controlnet_config(zoo_config, pairs, "flux")


def _flux_batch(seed: int = 0):
    from simpletuner.testing.zoo import TINY_FLUX_CLIP_HIDDEN, TINY_FLUX_LATENT_CHANNELS, TINY_FLUX_T5_WIDTH

    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 2 * TINY_FLUX_LATENT_CHANNELS, 8, 8, generator=g)  # image, then conditioning latents
    cond = {
        "prompt_embeds": torch.randn(2, 5, TINY_FLUX_T5_WIDTH, generator=g),
        "pooled_prompt_embeds": torch.randn(2, TINY_FLUX_CLIP_HIDDEN, generator=g),
    }
    return latents, cond


def test_flux_step0_is_the_base_loss_and_the_conditioning_latents_reach_the_transformer(flux_config):
    from simpletuner.models.flux_controlnet import FluxControlNetSpec
    from simpletuner.testing.zoo import TINY_FLUX_LATENT_CHANNELS as C

    spec = get_model_spec(validate_config(flux_config()))
    assert type(spec) is FluxControlNetSpec and spec.conditions_on_image and not spec.prompt_sees_source
    model = spec.prepare_denoiser(spec.load_denoiser(), torch.float32)
    base_config = model.base.config
    assert model.controlnet.config.num_layers == min(4, base_config.num_layers)
    assert model.controlnet.config.num_single_layers == min(10, base_config.num_single_layers)
    assert not any(p.requires_grad for p in model.base.parameters())
    latents, cond = _flux_batch()
    plain = get_model_spec(validate_config(flux_config(controlnet=False)))
    with torch.no_grad():
        got = spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))
        base = plain.training_loss(model.base, latents[:, :C], cond, torch.Generator().manual_seed(3))
    assert torch.equal(got, base)  # zero-initialised output linears: a fresh ControlNet adds nothing
    zeroed = (model.controlnet.controlnet_blocks, model.controlnet.controlnet_single_blocks)
    for p in (p for part in zeroed for p in part.parameters()):
        p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    model.controlnet.controlnet_x_embedder.weight.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    loss = spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))
    other = torch.cat([latents[:, :C], latents[:, C:].flip(-1)], 1)
    with torch.no_grad():
        changed = spec.training_loss(model, other, cond, torch.Generator().manual_seed(3))
    assert (loss - changed).abs().max() > 1e-4  # the conditioning latents reach the ControlNet
    loss.sum().backward()
    assert model.controlnet.controlnet_x_embedder.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.base.parameters())


def _render_flux(model_folder: Path, controlnet, control: Image.Image):
    from diffusers import FluxControlNetPipeline

    pipe = FluxControlNetPipeline.from_pretrained(str(model_folder), controlnet=controlnet, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    args = dict(height=64, width=64, num_inference_steps=1, output_type="pt", max_sequence_length=16)
    return pipe("a circle", control_image=control, generator=torch.Generator().manual_seed(0), **args).images


@pytest.mark.parametrize("training_type, precision", [("full", None), ("lora", None), ("lora", "qint8")])
def test_flux_run_writes_what_the_controlnet_pipeline_loads(
    flux_config, zoo, pairs, tmp_path, training_type, precision
):
    """The folder holds the trained ControlNet; a LoRA run's, the LoRA merged (with an int8 base, as SimpleTuner
    quantises the ControlNet's frozen layers too, merged onto their dequantised weights)."""
    from diffusers import FluxControlNetModel

    extra = {"lora_rank": 4, "learning_rate": 5e-2} if training_type == "lora" else {}
    if precision is not None:
        extra["base_model_precision"] = precision
    raw = flux_config(
        training_type=training_type,
        output_dir=str(tmp_path / "out"),
        validation_prompt="a circle",
        validation_num_inference_steps=1,
        validation_steps=1,
        **extra,
    )
    trainer, result = train(raw)
    assert result.global_step == 1 and all(math.isfinite(x) for x in result.losses)
    assert [p.name for p in result.validation_images][-1] == "step_000001_0.png"  # from the first pair's control
    out = Path(raw["output_dir"])
    folder = out / CONTROLNET_FOLDER
    loaded = FluxControlNetModel.from_pretrained(str(folder), use_safetensors=True).eval()
    trained = trainer.accelerator.unwrap_model(trainer.model).controlnet.eval()
    if training_type == "full":
        assert result.output_path == folder
        for name, value in trained.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), name
    else:
        assert result.output_path == out / LORA_FILE
        base = get_model_spec(validate_config(raw)).load_denoiser().controlnet.eval()
        base.load_lora_adapter(str(out / LORA_FILE), prefix=LORA_PREFIX)
        merged = dict(loaded.named_parameters())
        for name, module in base.named_modules():  # the adapter on the fresh ControlNet = the merged folder
            if name in ("controlnet_x_embedder", "controlnet_blocks.0", "controlnet_single_blocks.0"):
                x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(0))
                with torch.no_grad():
                    want = x @ merged[name + ".weight"].T + merged[name + ".bias"]
                    if precision is None:  # the fresh ControlNet's float weights are the merged folder's base
                        assert torch.allclose(module(x), want, atol=1e-5), name
                    assert torch.allclose(trained.get_submodule(name)(x), want, atol=1e-4), name
    image = _render_flux(zoo("flux"), loaded, Image.open(pairs[1] / "000.png").convert("RGB"))
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_memory_estimate_counts_the_frozen_base_and_the_trained_controlnet(sdxl_config, flux_config, family):
    from simpletuner.memory.estimator import batch_shapes, estimate_memory
    from simpletuner.models.sdxl_controlnet import CONTROL_PIXELS

    cfg = validate_config((sdxl_config if family == "sdxl" else flux_config)())
    est = estimate_memory(cfg, device_kind="cpu")
    model = get_model_spec(cfg).load_denoiser()
    num_base = sum(p.numel() for p in model.base.parameters())
    num_controlnet = sum(p.numel() for p in model.controlnet.parameters())
    assert est.weights == 4 * (num_base + num_controlnet)  # fp32 here (mixed_precision no)
    assert est.gradients == 4 * num_controlnet and est.optimizer_state == 8 * num_controlnet  # AdamW: two moments
    _, cond = batch_shapes(cfg, 2)
    if family == "sdxl":  # the conditioning image rides with the latents as uint8 pixels: 3 bytes a pixel cached
        assert cond[CONTROL_PIXELS].shape == (2, 3, 64, 64) and cond[CONTROL_PIXELS].dtype == torch.uint8
        assert get_model_spec(cfg).pixel_entry_bytes(64, 32) == 3 * 64 * 32 + 100
    else:  # Flux's conditioning latents are cached with the image's: twice the channels
        assert CONTROL_PIXELS not in cond and est.latent_shape[0] == 2 * model.base.config.in_channels // 4


def test_controlnet_refusals(zoo_config, sdxl_config, pairs, zoo):
    sd = config_problems(zoo_config("sd", controlnet=True))
    assert "ControlNet for model families sdxl, flux only, not 'sd'" in sd
    assert "set controlnet true" in config_problems(sdxl_config(controlnet=False, controlnet_model_name_or_path="x"))
    assert "remove train_text_encoder" in config_problems(sdxl_config(training_type="lora", train_text_encoder=True))
    assert "lora_type 'lycoris' is not supported" in config_problems(
        sdxl_config(training_type="lora", lora_type="lycoris")
    )
    assert "output_formats ['diffusers']" in config_problems(
        sdxl_config(training_type="lora", output_formats=["diffusers", "kohya"])
    )
    tread = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 0}]}
    assert "remove tread_config" in config_problems(zoo_config("flux", controlnet=True, tread_config=tread))
    kontext = validate_config(zoo_config("flux_kontext", "flux", controlnet=True, datasets=_datasets(pairs)))
    with pytest.raises(ValueError, match="FluxKontextPipeline .* no ControlNet trains here"):
        get_model_spec(kontext)


# --- SimpleTuner's configs ---------------------------------------------------------------------------------------


def _st_controlnet_project(tmp_path: Path, pairs, model: Path) -> Path:
    """SimpleTuner's simpletuner/examples/sdxl.peft-controlnet-lora/config.json (commit bc8e6ab; the keys that decide
    what is trained) with documentation/CONTROLNET.md's dataloader (`conditioning_data` naming a `dataset_type:
    conditioning` entry), paths and sizes swapped for tiny ones."""

    root = tmp_path / "project"
    (root / "config").mkdir(parents=True)
    (root / "datasets").mkdir()
    os.symlink(pairs[0], root / "datasets" / "antelope-data")
    os.symlink(pairs[1], root / "datasets" / "antelope-conditioning")
    common = {
        "type": "local",
        "caption_strategy": "instanceprompt",
        "instance_prompt": "an antelope",
        "metadata_backend": "discovery",
        "crop": True,
        "crop_aspect": "square",
        "crop_style": "center",
        "resolution": 64,
        "resolution_type": "pixel_area",
        "cache_file_suffix": "controlnet-sdxl",
    }
    datasets = [
        {
            "id": "antelope-data",
            "dataset_type": "image",
            "conditioning_data": "antelope-conditioning",
            "instance_data_dir": "datasets/antelope-data",
            "cache_dir_vae": "cache/vae/sdxl/antelope-data",
            **common,
        },
        {
            "id": "antelope-conditioning",
            "dataset_type": "conditioning",
            "instance_data_dir": "datasets/antelope-conditioning",
            **common,
        },
        {
            "id": "an example backend for text embeds.",
            "dataset_type": "text_embeds",
            "default": True,
            "type": "local",
            "cache_dir": "cache/text/sdxl-base/controlnet",
        },
    ]
    (root / "config" / "multidatabackend.json").write_text(json.dumps(datasets))
    raw = {
        "controlnet": True,
        "data_backend_config": "config/multidatabackend.json",
        "gradient_checkpointing": True,
        "learning_rate": 1e-4,
        "lora_rank": 4,
        "lora_alpha": 4,
        "lr_scheduler": "constant_with_warmup",
        "lr_warmup_steps": 0,
        "max_train_steps": 1,
        "mixed_precision": "no",
        "model_family": "sdxl",
        "model_type": "lora",
        "num_train_epochs": 0,
        "optimizer": "adamw_bf16",
        "output_dir": "output/examples/sdxl.peft-controlnet-lora",
        "pretrained_model_name_or_path": str(model),
        "pretrained_vae_model_name_or_path": str(model),  # its own VAE (SimpleTuner's sdxl default is a Hub one)
        "resolution": 64,
        "resolution_type": "pixel_area",
        "seed": 42,
        "train_batch_size": 1,
        "validation_prompt": "an antelope",
        "validation_num_inference_steps": 1,
        "validation_resolution": "64x64",
        "validation_steps": 50,
        "report_to": "none",
    }
    (root / "config" / "config.json").write_text(json.dumps(raw))
    return root


def test_the_simpletuner_controlnet_example_trains(tmp_path, pairs, zoo, monkeypatch):

    from simpletuner.cli import main
    from simpletuner.configuration.simpletuner import translate as dialect

    root = _st_controlnet_project(tmp_path, pairs, zoo("sdxl"))
    raw = json.loads((root / "config" / "config.json").read_text())
    native, report = dialect.translate(raw, root / "config" / "config.json", root)
    assert native["controlnet"] is True and "lora_target_modules" not in native
    (dataset,) = native["datasets"]
    assert dataset["conditioning_data_dir"] == os.path.join(root, "datasets", "antelope-conditioning")
    assert any(line.startswith("`controlnet`") and "[0, 1]" in line for line in report.approximated)
    monkeypatch.chdir(root)
    assert main(["train", "--config", str(root / "config" / "config.json")]) == 0
    out = root / "output" / "examples" / "sdxl.peft-controlnet-lora"
    assert (out / LORA_FILE).is_file() and (out / CONTROLNET_FOLDER / "config.json").is_file()
