"""SimpleTuner's published examples, held to: each trains here with the same meaning, or stops naming
only keys that are genuinely unsupported.

The configs below are this project's own reconstruction of six of SimpleTuner's published examples
(read at commit bc8e6ab of bghira/SimpleTuner: config/config.json.example and its lycoris_config, the
sd1x-dreamshaper and sdxl LoKr examples, the Flux LoRA, the Wan 2.1 1.3B LoRA and the Wan 2.2 I2V
"high" run, with their dataloader JSONs): the keys and values that decide what is trained, with only
the model and data paths replaced by local tiny models and folders (a hub dataset becomes a local
folder of the same kind).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from simpletuner.configuration import load_config
from simpletuner.configuration.errors import ConfigError
from simpletuner.testing.demo_data import write_shapes_dataset

#: Settings every published example repeats that do not change what is trained.
_PUBLISHING = {"push_to_hub": False, "push_checkpoints_to_hub": False, "hub_model_id": "simpletuner-example"}
_TREAD = {"routes": [{"selection_ratio": 0.1, "start_layer_idx": 2, "end_layer_idx": 8}]}


def _dreambooth(resolution: int, resolution_type: str, minimum: int) -> list[dict]:
    """SimpleTuner's small-dreambooth dataloader: square random crops of an instance-prompted set."""
    return [
        {
            "id": f"dreambooth-{resolution}",
            "type": "local",
            "instance_data_dir": "datasets/dreambooth",
            "crop": True,
            "crop_style": "random",
            "crop_aspect": "square",
            "minimum_image_size": minimum,
            "maximum_image_size": resolution,
            "target_downsample_size": resolution,
            "resolution": resolution,
            "resolution_type": resolution_type,
            "caption_strategy": "instanceprompt",
            "instance_prompt": "🟫",
            "cache_dir_vae": f"cache/vae/{{model_family}}/dreambooth-{resolution}",
        },
        {
            "id": "alt-embed-cache",
            "dataset_type": "text_embeds",
            "default": True,
            "type": "local",
            "cache_dir": "cache/text/{model_family}",
        },
    ]


def _sd1x(model: str) -> tuple[dict, list]:
    config = {
        **_PUBLISHING,
        "base_model_precision": "no_change",
        "caption_dropout_probability": 0.1,
        "checkpoint_step_interval": 50,
        "checkpoints_total_limit": 5,
        "data_backend_config": "config/multidatabackend.json",
        "disable_bucket_pruning": True,
        "gradient_checkpointing": True,
        "learning_rate": 1e-4,
        "lora_rank": 16,
        "lora_type": "standard",
        "lr_scheduler": "constant",
        "max_train_steps": 100,
        "mixed_precision": "bf16",
        "model_family": "sd1x",
        "model_flavour": "dreamshaper",
        "pretrained_model_name_or_path": model,
        "model_type": "lora",
        "num_train_epochs": 0,
        "optimizer": "adamw_bf16",
        "output_dir": "output/examples/sd1x-dreamshaper.peft-lora",
        "report_to": "none",
        "resolution": 512,
        "resolution_type": "pixel",
        "seed": 42,
        "train_batch_size": 1,
        "use_ema": False,
        "vae_batch_size": 1,
        "validation_guidance": 7.0,
        "validation_num_inference_steps": 20,
        "validation_prompt": "domokun holding a sign",
        "validation_prompt_library": False,
        "validation_resolution": "512x512",
        "validation_seed": 42,
        "validation_steps": 50,
    }
    return config, _dreambooth(512, "pixel", 128)


def _sdxl_lokr(model: str) -> tuple[dict, list]:
    config = {
        **_PUBLISHING,
        "aspect_bucket_rounding": 2,
        "caption_dropout_probability": 0.1,
        "checkpoint_step_interval": 50,
        "checkpoints_total_limit": 5,
        "data_backend_config": "config/multidatabackend.json",
        "disable_benchmark": False,
        "gradient_checkpointing": True,
        "learning_rate": 3e-7,
        "lora_type": "lycoris",
        "loss_type": "huber",
        "lycoris_config": "config/lycoris_config.json",
        "lr_scheduler": "constant",
        "max_train_steps": 100,
        "minimum_image_size": 0,
        "mixed_precision": "bf16",
        "model_family": "sdxl",
        "model_type": "lora",
        "num_train_epochs": 0,
        "optimizer": "adamw_bf16",
        "output_dir": "output/examples/sdxl.lycoris-lokr",
        "pretrained_model_name_or_path": model,
        "resolution": 1024,
        "resolution_type": "pixel_area",
        "resume_from_checkpoint": "latest",
        "seed": 42,
        "train_batch_size": 1,
        "use_ema": False,
        "validation_guidance": 4.2,
        "validation_guidance_rescale": 0.0,
        "validation_num_inference_steps": 20,
        "validation_prompt": "🟫 is holding a sign that says hello world from sdxl",
        "validation_resolution": "1024x1024",
        "validation_seed": 42,
        "validation_steps": 50,
    }
    return config, _dreambooth(1024, "pixel_area", 256)


_SDXL_LYCORIS = {
    "bypass_mode": True,
    "algo": "lokr",
    "multiplier": 1.0,
    "linear_dim": 10000,
    "linear_alpha": 1,
    "factor": 12,
    "apply_preset": {"target_module": ["Attention"], "module_algo_map": {"Attention": {"factor": 12}}},
}


def _flux_with_regularisation(model: str) -> tuple[dict, list]:
    config = {
        **_PUBLISHING,
        "base_model_precision": "int8-quanto",
        "checkpoint_step_interval": 10,
        "controlnet": False,
        "data_backend_config": "config/multidatabackend.json",
        "disable_bucket_pruning": True,
        "flow_schedule_shift": 3,
        "fuse_qkv_projections": False,
        "grad_clip_method": "value",
        "gradient_checkpointing": True,
        "learning_rate": 1e-4,
        "lora_alpha": 16,
        "lora_rank": 16,
        "lora_type": "standard",
        "lr_scheduler": "constant",
        "max_train_steps": 100,
        "mixed_precision": "bf16",
        "model_family": "flux",
        "model_type": "lora",
        "num_eval_images": 25,
        "num_train_epochs": 0,
        "optimizer": "adamw_bf16",
        "output_dir": "output/examples/flux.peft-lora",
        "pretrained_model_name_or_path": model,
        "quantize_via": "cpu",
        "report_to": "none",
        "seed": 42,
        "tracker_project_name": "lora-training",
        "tracker_run_name": "example-training-run",
        "train_batch_size": 1,
        "use_ema": False,
        "vae_batch_size": 1,
        "validation_disable_unconditional": True,
        "validation_guidance": 4.0,
        "validation_guidance_rescale": 0.0,
        "validation_negative_prompt": "ugly, cropped, blurry, low-quality, mediocre average",
        "validation_num_inference_steps": 16,
        "validation_prompt": "🟫 is holding a sign that says hello world from flux",
        "validation_prompt_library": False,
        "validation_resolution": "1024x1024",
        "validation_seed": 42,
        "validation_steps": 50,
    }
    datasets = _dreambooth(512, "pixel", 128)
    regularisation = {
        **datasets[0],
        "id": "regularisation",
        "instance_data_dir": "datasets/regularisation",
        "is_regularisation_data": True,
        "caption_strategy": "textfile",
        "cache_dir_vae": "cache/vae/{model_family}/regularisation",
    }
    del regularisation["instance_prompt"]
    return config, [datasets[0], regularisation, datasets[1]]


def _wan(model: str, flavour: str | None) -> tuple[dict, list]:
    config = {
        **_PUBLISHING,
        "aspect_bucket_rounding": 2,
        "attention_mechanism": "diffusers",
        "base_model_precision": "int8-torchao",
        "caption_dropout_probability": 0.1,
        "checkpoint_step_interval": 100,
        "checkpoints_total_limit": 5,
        "compress_disk_cache": True,
        "data_backend_config": "config/multidatabackend.json",
        "delete_problematic_images": False,
        "disable_benchmark": True,
        "disable_bucket_pruning": True,
        "ema_update_interval": 2,
        "grad_clip_method": "value",
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": True,
        "strict_epoch_limit": False,
        "learning_rate": 6e-5,
        "lora_rank": 16,
        "lora_type": "standard",
        "lr_scheduler": "constant_with_warmup",
        "lr_warmup_steps": 50,
        "max_grad_norm": 0.1,
        "max_train_steps": 100,
        "minimum_image_size": 0,
        "mixed_precision": "bf16",
        "model_family": "wan",
        "model_type": "lora",
        "num_train_epochs": 0,
        "offload_during_startup": True,
        "optimizer": "adamw_bf16",
        "output_dir": "output/examples/wan",
        "pretrained_model_name_or_path": model,
        "pretrained_t5_model_name_or_path": model,
        "quantize_via": "cpu",
        "report_to": "none",
        "resolution": 480,
        "resolution_type": "pixel_area",
        "resume_from_checkpoint": "latest",
        "seed": 42,
        "train_batch_size": 2,
        "tread_config": _TREAD,
        "use_ema": False,
        "vae_batch_size": 1,
        "vae_enable_tiling": True,
        "vae_enable_slicing": True,
        "validation_guidance": 4.0,
        "validation_num_inference_steps": 40,
        "validation_num_video_frames": 81,
        "validation_prompt": "🟫 is holding a sign that says hello world from wan",
        "validation_prompt_library": False,
        "validation_resolution": "832x480",
        "validation_seed": 42,
        "validation_steps": 50,
    }
    if flavour is not None:
        config["model_flavour"] = flavour
    datasets = [
        {
            "id": "dreambooth-480",
            "type": "local",
            "dataset_type": "video",
            "instance_data_dir": "datasets/video",
            "crop": False,
            "crop_style": "random",
            "crop_aspect": "square",
            "minimum_image_size": 128,
            "maximum_image_size": 480,
            "target_downsample_size": 480,
            "resolution": 480,
            "resolution_type": "pixel_area",
            "caption_strategy": "textfile",
            "cache_dir_vae": "cache/vae/{model_family}/dreambooth-480",
        },
        {
            "id": "alt-embed-cache",
            "dataset_type": "text_embeds",
            "default": True,
            "type": "local",
            "cache_dir": "cache/text/{model_family}",
        },
    ]
    return config, datasets


def _flux_lycoris_example(model: str) -> tuple[dict, list]:
    """config/config.json.example: `--` keys, string values, a Flux LyCORIS run."""
    config = {
        "--resume_from_checkpoint": "latest",
        "--data_backend_config": "config/multidatabackend.json",
        "--aspect_bucket_rounding": 2,
        "--seed": 42,
        "--minimum_image_size": 0,
        "--output_dir": "output/models",
        "--lora_type": "lycoris",
        "--lycoris_config": "config/lycoris_config.json",
        "--max_train_steps": 10000,
        "--num_train_epochs": 0,
        "--checkpoint_step_interval": 500,
        "--checkpoints_total_limit": 5,
        "--hub_model_id": "simpletuner-lora",
        "--push_to_hub": "true",
        "--push_checkpoints_to_hub": "true",
        "--tracker_project_name": "lora-training",
        "--tracker_run_name": "simpletuner-lora",
        "--report_to": "wandb",
        "--model_type": "lora",
        "--pretrained_model_name_or_path": model,
        "--model_family": "flux",
        "--train_batch_size": 1,
        "--gradient_checkpointing": "true",
        "--caption_dropout_probability": 0.1,
        "--resolution_type": "pixel_area",
        "--resolution": 1024,
        "--validation_seed": 42,
        "--validation_step_interval": 500,
        "--validation_resolution": "1024x1024",
        "--validation_guidance": 3.0,
        "--validation_guidance_rescale": "0.0",
        "--validation_num_inference_steps": "20",
        "--validation_prompt": "A photo-realistic image of a cat",
        "--mixed_precision": "bf16",
        "--optimizer": "adamw_bf16",
        "--learning_rate": "1e-4",
        "--lr_scheduler": "polynomial",
        "--lr_warmup_steps": 100,
        "--validation_torch_compile": "false",
        "--disable_benchmark": "false",
    }
    return config, _dreambooth(1024, "pixel_area", 1024)


_FLUX_LYCORIS = {
    "algo": "lokr",
    "multiplier": 1.0,
    "full_matrix": True,
    "linear_alpha": 1,
    "factor": 16,
    "apply_preset": {
        "target_module": ["Attention", "FeedForward"],
        "module_algo_map": {"Attention": {"factor": 16}, "FeedForward": {"factor": 8}},
    },
}


# --- the project folder ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    root = tmp_path_factory.mktemp("example-models")
    families = ("sd", "sdxl", "flux", "wan", "wan22_i2v", "wan22_ti2v")
    return {family: write_tiny_model(family, root / family) for family in families}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Images of the sizes a dreambooth set has: two landscape, one square, one portrait, and one too small
    for the 512 examples' `minimum_image_size` (128 px shorter side)."""
    root = tmp_path_factory.mktemp("example-images")
    sizes = ((1200, 800), (960, 640), (1024, 1024), (768, 1152), (120, 100))
    data = write_shapes_dataset(root / "dreambooth", num_images=5, sizes=sizes)
    reg = write_shapes_dataset(root / "regularisation", num_images=3, sizes=((640, 640), (800, 600), (600, 800)))
    return data, reg


def _write(tmp_path: Path, images, built: tuple[dict, list], lycoris: dict | None = None) -> Path:
    root = tmp_path / "simpletuner"
    (root / "config").mkdir(parents=True)
    (root / "datasets").mkdir()
    (root / "datasets" / "dreambooth").symlink_to(images[0])
    (root / "datasets" / "regularisation").symlink_to(images[1])
    config, datasets = built
    (root / "config" / "multidatabackend.json").write_text(json.dumps(datasets))
    if lycoris is not None:
        (root / "config" / "lycoris_config.json").write_text(json.dumps(lycoris))
    path = root / "config" / "config.json"
    path.write_text(json.dumps(config, ensure_ascii=False))
    return path


def _named_keys(error: ConfigError) -> set[str]:
    """The keys the stop names: the first `backticked` name of each problem line."""
    named = set()
    for line in error.problems:
        match = re.search(r"`([a-z0-9_.\-]+)", line)
        if match and not line.startswith("(read as"):
            named.add(match.group(1).split(":")[0])
    return named


def _scan(config) -> list:
    from simpletuner.data_backend import build_datasets

    return build_datasets(config)


def test_sd1x_dreambooth_reads_square_crops_and_the_instance_prompt(tmp_path, models, images, monkeypatch):
    """The example's meaning as loaded; tests/test_hub_examples.py::test_sd1x_dreamshaper_example_trains_from_the_
    hub_cache trains the same example with `simpletuner train`."""
    path = _write(tmp_path, images, _sd1x(str(models["sd"])))
    monkeypatch.chdir(path.parent.parent)
    config = load_config(path).config
    assert (config.model_family, config.training_type, config.lora_rank) == ("sd", "lora", 16)
    assert (config.optimizer, config.mixed_precision, config.lr_scheduler) == ("adamw_bf16", "bf16", "constant")
    assert (config.max_grad_norm, config.grad_clip_method, config.lora_dropout) == (2.0, "value", 0.1)
    assert config.caption_dropout_probability == 0.1 and config.vae_batch_size == 1
    assert (config.validation_seed, config.validation_guidance_scale) == (42, 7.0)
    (dataset,) = _scan(config)
    # pixel 512, square crops: every kept image trains at 512x512; the 120x100 image is under the minimum
    assert len(dataset.samples) == 4
    assert {s.bucket for s in dataset.samples} == {(512, 512)}
    assert {s.caption for s in dataset.samples} == {"🟫"}


def test_sdxl_lokr_reads_its_lycoris_file(tmp_path, models, images, monkeypatch):
    path = _write(tmp_path, images, _sdxl_lokr(str(models["sdxl"])), _SDXL_LYCORIS)
    monkeypatch.chdir(path.parent.parent)
    config = load_config(path).config
    assert (config.lora_type, config.lycoris.algo, config.lycoris.factor) == ("lycoris", "lokr", 12)
    preset = config.lycoris.apply_preset.model_dump(exclude_defaults=True)
    assert preset["target_module"] == ["Attention"]
    assert preset["module_algo_map"]["Attention"]["factor"] == 12
    assert (config.lora_rank, config.lora_alpha, config.loss_type) == (10000, 1, "huber")
    (dataset,) = _scan(config)
    assert {s.bucket for s in dataset.samples} == {(1024, 1024)}  # pixel_area 1024, square crops
    assert len(dataset.samples) == 4  # 120x100 is under 256 px of area-equivalent side


def test_flux_lora_with_regularisation_data(tmp_path, models, images, monkeypatch):
    path = _write(tmp_path, images, _flux_with_regularisation(str(models["flux"])))
    monkeypatch.chdir(path.parent.parent)
    config = load_config(path).config
    assert config.base_model_precision == "qint8" and config.flow_shift == 3.0
    assert (config.timestep_sampling, config.logit_std) == ("logit_normal", 1.0)
    assert "to_add_out" in config.lora_target_modules  # SimpleTuner's default flux_lora_target: all
    assert config.validation_negative_prompt.startswith("ugly")
    plain, regularisation = _scan(config)
    assert [d.config.is_regularisation_data for d in (plain, regularisation)] == [False, True]
    assert {s.caption for s in regularisation.samples} != {"🟫"}  # its own text files


@pytest.mark.parametrize(
    "flavour, model", [(None, "wan"), ("i2v-14b-2.2-high", "wan22_i2v"), ("ti2v-5b-2.2", "wan22_ti2v")]
)
def test_wan_examples_load_with_their_tread_routes(tmp_path, models, images, monkeypatch, flavour, model):
    path = _write(tmp_path, images, _wan(str(models[model]), flavour))
    monkeypatch.chdir(path.parent.parent)
    # With what the example's video dataset lacks (num_frames, a folder, a size that fits the buckets) it loads
    # with the flavour's meaning and its TREAD routes (checked against the blocks when the model folder is read).
    raw = json.loads(path.read_text())
    raw["resolution"] = 512
    path.write_text(json.dumps(raw))
    backends = path.parent / "multidatabackend.json"
    datasets = json.loads(backends.read_text())
    datasets[0].update(num_frames=5, resolution=512)
    backends.write_text(json.dumps(datasets))
    (path.parent.parent / "datasets" / "video").mkdir()
    config = load_config(path).config
    assert config.train_stages == ("high" if flavour == "i2v-14b-2.2-high" else "both")
    assert config.ti2v_first_frame == (flavour == "ti2v-5b-2.2")
    assert config.tread_config is not None and config.tread_config.model_dump() == _TREAD


def test_config_json_example_trains_its_meaning_with_its_hub_uploads(tmp_path, models, images, monkeypatch):
    path = _write(tmp_path, images, _flux_lycoris_example(str(models["flux"])), _FLUX_LYCORIS)
    monkeypatch.chdir(path.parent.parent)
    raw = json.loads(path.read_text())
    raw.update({"--report_to": "none"})  # wandb is not installed here
    path.write_text(json.dumps(raw))
    config = load_config(path).config
    assert (config.push_to_hub, config.push_checkpoints_to_hub, config.push_to_hub_background) == (True, True, False)
    assert config.hub_repo_id == "simpletuner-lora" and config.model_card_private is True
    assert (config.lycoris.algo, config.lycoris.factor, config.lycoris.full_matrix) == ("lokr", 16, True)
    assert config.lora_alpha == 1 and config.lr_scheduler == "polynomial"
    assert (config.max_train_steps, config.checkpointing_steps, config.validation_steps) == (10000, 500, 500)
    assert config.validation_guidance_rescale == 0.0 and config.validation_num_inference_steps == 20


@pytest.mark.parametrize("framerate, frames", [(None, 73), (16, 73), (24, 113)])
def test_a_video_dataset_without_num_frames_gets_simpletuners_default(
    tmp_path, models, images, monkeypatch, caplog, framerate, frames
):
    """SimpleTuner trains 5 s of each clip when `video.num_frames` is left out (data_backend/factory.py:805-812):
    at `framerate`, which Wan sets to 15 when unset (wan/model.py:1555-1556), rounded down to 8k+1
    (wan/model.py:458-464): 75 -> 73, 80 -> 73, 120 -> 113. A warning, not a refusal."""
    import logging

    path = _write(tmp_path, images, _wan(str(models["wan"]), None))
    monkeypatch.chdir(path.parent.parent)
    raw = json.loads(path.read_text())
    del raw["tread_config"]
    raw["resolution"] = 512
    if framerate is not None:
        raw["framerate"] = framerate
    path.write_text(json.dumps(raw))
    backends = path.parent / "multidatabackend.json"
    datasets = json.loads(backends.read_text())
    datasets[0].update(resolution=512)
    backends.write_text(json.dumps(datasets))
    (path.parent.parent / "datasets" / "video").mkdir()
    with caplog.at_level(logging.INFO, logger="simpletuner.configuration.loader"):
        config = load_config(path).config
    assert config.datasets[0].num_frames == frames
    forced = "\n".join(r.getMessage() for r in caplog.records)
    assert f"video.num_frames` left out -> {frames}: SimpleTuner trains 5 s of each clip" in forced
