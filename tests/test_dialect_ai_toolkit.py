"""ai-toolkit job files read here: its published examples (commit 27a03a91 of ostris/ai-toolkit, config/examples/,
copied below with only the model, the data folder and the resolutions swapped for the tiny local models) translate
or stop naming the key; one trains end to end through `simpletuner train`; seed 001's blocks (sections 8.3 and
10.3) train on the tiny Wan 2.2; `convert` writes a native config equal to the translation; the job's shape is
checked; the foreign-key pointers stay for flat configs only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from simpletuner.cli import main
from simpletuner.cli.demo import write_shapes_dataset
from simpletuner.configuration import load_config
from simpletuner.configuration.errors import ConfigError
from simpletuner.configuration.loader import read_raw_config

HEAD = """job: extension
config:
  name: "my_first_lora_v1"
  process:
    - type: 'sd_trainer'
      training_folder: "output"
      device: cuda:0
"""


def _example(
    model: str,
    arch_lines: str,
    train_lines: str,
    network: str = 'type: "lora"\n        linear: 16\n        linear_alpha: 16',
) -> str:
    """The shape every published trainer example shares (train_lora_*_24gb.yaml), with its own model/train keys."""
    return (
        HEAD
        + f"""      network:
        {network}
      save:
        dtype: float16
        save_every: 250
        max_step_saves_to_keep: 4
        push_to_hub: false
      datasets:
        - folder_path: "DATA"
          caption_ext: "txt"
          caption_dropout_rate: 0.05
          shuffle_tokens: false
          cache_latents_to_disk: true
          resolution: [ 64, 128, 192 ]
      train:
        batch_size: 1
        steps: 2000
        gradient_accumulation_steps: 1
        train_unet: true
        train_text_encoder: false
        gradient_checkpointing: true
        noise_scheduler: "flowmatch"
{train_lines}
        dtype: bf16
      model:
        name_or_path: "{model}"
{arch_lines}
      sample:
        sampler: "flowmatch"
        sample_every: 250
        width: 64
        height: 64
        prompts:
          - "woman with red hair, playing chess at the park, bomb going off in the background"
        neg: ""
        seed: 42
        walk_seed: true
        guidance_scale: 4
        sample_steps: 20
meta:
  name: "[name]"
  version: '1.0'
"""
    )


#: The published examples (model arch and train lines as in each file), and the key each one stops on, if any.
EXAMPLES = {
    "train_lora_flux_24gb": (
        "flux",
        "        is_flux: true\n        quantize: true",
        '        optimizer: "adamw8bit"\n        lr: 1e-4',
        None,
    ),
    "train_lora_flux_kontext_24gb": (
        "flux",
        '        arch: "flux_kontext"\n        quantize: true',
        '        optimizer: "adamw8bit"\n        lr: 1e-4\n        timestep_type: "weighted"',
        "train.timestep_type",
    ),
    "train_lora_sd35_large_24gb": (
        "sd3",
        "        is_v3: true\n        quantize: true",
        '        timestep_type: "linear"\n        optimizer: "adamw8bit"\n        lr: 1e-4',
        None,
    ),
    "train_lora_wan21_1b_24gb": (
        "wan",
        "        arch: 'wan21'",
        "        timestep_type: 'sigmoid'\n        optimizer: \"adamw8bit\"\n        lr: 1e-4",
        None,
    ),
    "train_lora_wan21_14b_24gb": (
        "wan",
        "        arch: 'wan21'\n        quantize: true",
        "        timestep_type: 'sigmoid'\n        optimizer: \"adamw8bit\"\n        lr: 1e-4",
        None,
    ),
    "train_lora_wan22_14b_24gb": (
        "wan22",
        (
            "        arch: 'wan22_14b'\n"
            "        quantize: true\n"
            '        qtype: "uint4|ostris/accuracy_recovery_adapters/wan22_14b_t2i_torchao_uint4.safetensors"\n'
            "        low_vram: true\n"
            "        model_kwargs:\n"
            "          train_high_noise: true\n"
            "          train_low_noise: true"
        ),
        (
            "        timestep_type: 'linear'\n"
            '        optimizer: "adamw8bit"\n'
            "        lr: 1e-4\n"
            "        optimizer_params:\n"
            "          weight_decay: 1e-4\n"
            "        switch_boundary_every: 10\n"
            "        cache_text_embeddings: true"
        ),
        "model.qtype",
    ),
    "train_lora_qwen_image_24gb": (
        "qwen_image",
        (
            '        arch: "qwen_image"\n'
            "        quantize: true\n"
            '        qtype: "uint3|ostris/accuracy_recovery_adapters/qwen_image_torchao_uint3.safetensors"'
        ),
        '        optimizer: "adamw8bit"\n        lr: 1e-4\n        cache_text_embeddings: true',
        "model.qtype",
    ),
    "train_lora_qwen_image_edit_32gb": (
        "qwen_image_edit",
        (
            '        arch: "qwen_image_edit"\n'
            "        quantize: true\n"
            '        qtype: "uint3|qwen_image_edit_torchao_uint3.safetensors"'
        ),
        '        timestep_type: "weighted"\n        optimizer: "adamw8bit"\n        lr: 1e-4',
        "model.qtype train.timestep_type",
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    root = tmp_path_factory.mktemp("ait-models")
    return {f: write_tiny_model(f, root / f) for f in ("flux", "sd3", "wan", "wan22", "qwen_image", "qwen_image_edit")}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_shapes_dataset(
        tmp_path_factory.mktemp("ait-images") / "data", num_images=2, sizes=((96, 64), (64, 64))
    )


def _write(tmp_path: Path, text: str, images: Path, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text.replace("DATA", str(images)))
    return path


def _stops_on(error: ConfigError) -> set[str]:
    return {m.group(1) for line in error.problems if (m := re.match(r"`([\w.\[\]]+)", line))}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_published_examples_translate_or_stop_naming_the_key(tmp_path, models, images, monkeypatch, name):
    family, arch, train, stops = EXAMPLES[name]
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, _example(str(models[family]), arch, train), images)
    if stops is not None:
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        assert _stops_on(caught.value) == set(stops.split()), caught.value.problems
        return
    config = load_config(path).config
    assert config.lora_rank == 16 and config.lora_alpha == 16 and config.max_train_steps == 2000
    assert config.optimizer == "bnb-adamw8bit" and config.adam_epsilon == 1e-6 and config.learning_rate == 1e-4
    assert [d.resolution for d in config.datasets] == [64, 128, 192] and config.caption_dropout_probability == 0.05
    assert config.output_dir == str(tmp_path / "output" / "my_first_lora_v1")
    assert config.flow_shift == 1.0 and config.checkpointing_steps == 250 and config.checkpoints_total_limit == 4
    assert config.validation_prompts and config.validation_seed == 42 and config.mixed_precision == "bf16"


def test_wan21_example_trains_through_simpletuner_train(tmp_path, models, images, monkeypatch):
    family, arch, train, _ = EXAMPLES["train_lora_wan21_1b_24gb"]
    monkeypatch.chdir(tmp_path)
    path = _write(
        tmp_path, _example(str(models[family]), arch, train).replace("[ 64, 128, 192 ]", "[ 64, 128 ]"), images
    )
    overrides = ["max_train_steps=1", "validation_num_inference_steps=1", "optimizer=adamw", "mixed_precision=no"]
    assert main(["train", "--config", str(path), *[a for o in overrides for a in ("--set", o)]]) == 0
    assert list((tmp_path / "output" / "my_first_lora_v1").glob("*.safetensors"))


SEED_8_3 = """
dataset:
  resolution: 1024
  cache_latents_to_disk: true  # Recommended for 260 images
  augmentations_cache_mode: "static"  # or "refresh_each_epoch" for variety

optimizer:
  name: "automagic"
  high_noise_lr_bump: 1e-6
  low_noise_lr_bump: 5e-7
  high_noise_max_lr: 1e-3
  low_noise_max_lr: 5e-4
"""
SEED_10_3 = [
    "train:\n  gradient_checkpointing: true\n  batch_size: 1  # Start small\n",
    'train:\n  mixed_precision: "fp16"  # or "bf16" if supported\n',
]


def _seed_job(model: Path, images: Path, network: dict) -> dict:
    """A Wan 2.2 LyCORIS job holding seed 001's blocks verbatim (8.3; both of 10.3's `train` blocks, merged);
    swapped: the folder path added to its `dataset`, its 1024 resolution (beyond the tiny model) set to 64."""
    blocks = yaml.safe_load(SEED_8_3)
    train = {k: v for block in SEED_10_3 for k, v in yaml.safe_load(block)["train"].items()}
    blocks["dataset"] = {**blocks["dataset"], "folder_path": str(images), "resolution": 64}
    process = {
        "type": "sd_trainer",
        "training_folder": "output",
        "network": network,
        "model": {"name_or_path": str(model), "arch": "wan22_14b"},
        "train": {**train, "steps": 1, "lr": 1e-4, "noise_scheduler": "flowmatch", "timestep_type": "linear"},
        **blocks,
    }
    return {"job": "extension", "config": {"name": "seed", "process": [process]}}


def test_seed_blocks_train_dual_stage_lycoris_on_tiny_wan22(tmp_path, models, images, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = _seed_job(models["wan22"], images, {"type": "lokr", "linear": 4, "linear_alpha": 4, "lokr_factor": 2})
    path = tmp_path / "seed.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_config(path).config
    assert config.optimizer == "automagic" and config.train_stages == "both"
    assert (config.high_noise_lr_bump, config.low_noise_lr_bump) == (1e-6, 5e-7)
    assert (config.high_noise_max_lr, config.low_noise_max_lr) == (1e-3, 5e-4)
    assert config.augmentations_cache_mode == "static" and config.cache_config.vae_cache_type == "disk"
    assert (config.lora_type, config.lycoris.algo, config.gradient_checkpointing) == ("lycoris", "lokr", True)
    assert config.mixed_precision == "fp16" and config.train_batch_size == 1
    assert main(["train", "--config", str(path), "--set", "mixed_precision=no"]) == 0
    assert list((tmp_path / "output" / "seed").glob("*.safetensors"))


def test_seed_uvm_allocator_settings_stop_with_the_stock_pytorch_replacement(tmp_path, models, images, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "seed.json"
    path.write_text(json.dumps(_seed_job(models["wan22"], images, {"type": "lora", "linear": 4})))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "use_uvm:True,uvm_oversubscription_ratio:3.0")
    from simpletuner.cli.train import prepare_config

    with pytest.raises(ConfigError) as caught:
        prepare_config(str(path), launch_command=None)
    text = str(caught.value)
    assert "use_uvm" in text and "managed_memory" in text and "uvm_oversubscription_ratio" in text


def test_convert_writes_the_translation_which_trains_the_same_run(tmp_path, models, images, monkeypatch):
    family, arch, train, _ = EXAMPLES["train_lora_flux_24gb"]
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, _example(str(models[family]), arch, train), images)
    out = tmp_path / "native.json"
    assert main(["convert", str(path), "--out", str(out)]) == 0
    native = json.loads(out.read_text())
    assert native == read_raw_config(path)
    assert load_config(out).config == load_config(path).config
    assert main(["convert", str(out)]) == 2  # a native config: nothing to convert


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda j: j.update(job="extract"), "job: extract"),
        (lambda j: j["config"]["process"].append(dict(j["config"]["process"][0])), "holds 2 processes"),
        (lambda j: j["config"]["process"][0].update(type="concept_slider"), "not a trainer process"),
        (lambda j: j["config"]["process"][0]["network"].update(type="lorm"), "network.type"),
        (lambda j: j["config"]["process"][0]["train"].update(content_or_style="style"), "train.content_or_style"),
        (lambda j: j["config"]["process"][0]["train"].update(weight_jitter=0.1), "train.weight_jitter"),
    ],
)
def test_a_job_that_cannot_train_stops_naming_what(tmp_path, models, images, change, message):
    raw = _seed_job(models["wan22"], images, {"type": "lora", "linear": 4})
    change(raw)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path)


def test_a_translated_job_gets_no_foreign_key_pointers_but_a_flat_paste_does(tmp_path, models, images):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(_seed_job(models["wan22"], images, {"type": "lora", "linear": 4})))
    load_config(path, check_files=False)  # no "is an ai-toolkit key" error for its nested keys
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"pretrained_model_name_or_path": str(models["wan22"]), "network": {"linear": 4}}))
    with pytest.raises(ConfigError, match="ai-toolkit key"):
        load_config(flat, check_files=False)


def test_estimate_reads_an_ai_toolkit_job(tmp_path, models, images, monkeypatch, capsys):
    family, arch, train, _ = EXAMPLES["train_lora_wan21_1b_24gb"]
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, _example(str(models[family]), arch, train), images)
    assert main(["estimate", "--config", str(path), "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)["estimate"]
    # the job's figures, as translated: wan, bf16, micro-batch 1, gradient checkpointing on
    assert (estimate["model_family"], estimate["mixed_precision"], estimate["micro_batch_size"]) == ("wan", "bf16", 1)
    assert estimate["gradient_checkpointing"] is True
