"""ai-toolkit job files read here: its published examples (ostris/ai-toolkit at commit 27a03a91,
config/examples/train_lora_*.yaml for the families trained here, recorded as ai-toolkit reads them in
tests/data/ai_toolkit_examples/, with only the model, data and control-image paths and the sizes swapped for tiny
local ones) translate with ai-toolkit's meaning and train, or stop naming the key, and train once the stop's fix
is made; seed 001's blocks (sections 8.3 and 10.3) train on the tiny Wan 2.2; `convert` writes a native config
equal to the translation; the job's shape is checked; the foreign-key pointers stay for flat configs only.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from simpletuner.cli import main
from simpletuner.configuration import load_config
from simpletuner.configuration.aitoolkit.facts import AIT_COMMIT
from simpletuner.configuration.aitoolkit.reading import parse_job_text
from simpletuner.configuration.errors import ConfigError
from simpletuner.configuration.loader import read_raw_config
from simpletuner.testing.demo_data import write_edit_pairs, write_shapes_dataset

PUBLISHED = Path(__file__).parent / "data" / "ai_toolkit_examples"
#: A bare mirror of ostris/ai-toolkit, when present: the recorded examples are checked against its files.
MIRROR = Path("/work/.mirror/ostris+ai-toolkit/repo")

#: Each published example: the tiny model it trains on, the keys it stops on (None: it trains as published), and
#: the change each stop message asks for (which then trains).
EXAMPLES: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    "train_lora_flux_24gb": ("flux", None, {}),
    "train_lora_flux_kontext_24gb": ("flux_kontext", "train.timestep_type", {"train.timestep_type": "linear"}),
    "train_lora_flux_schnell_24gb": ("flux", "model.assistant_lora_path", {"model.assistant_lora_path": None}),
    "train_lora_flex_24gb": (
        "flux",
        "model.quantize_kwargs train.bypass_guidance_embedding",
        {"model.quantize_kwargs": None, "train.bypass_guidance_embedding": None},
    ),
    "train_lora_sd35_large_24gb": ("sd3", None, {}),
    "train_lora_wan21_1b_24gb": ("wan", None, {}),
    "train_lora_wan21_14b_24gb": ("wan", None, {}),
    "train_lora_wan22_14b_24gb": ("wan22", "model.qtype", {"model.qtype": "qfloat8"}),
    "train_lora_qwen_image_24gb": ("qwen_image", "model.qtype", {"model.qtype": "qfloat8"}),
    "train_lora_qwen_image_edit_32gb": (
        "qwen_image_edit",
        "model.qtype train.timestep_type",
        {"model.qtype": "qfloat8", "train.timestep_type": "linear"},
    ),
}
#: A CPU run of one step: the job's other keys stay as published.
ONE_STEP = ["--set", "max_train_steps=1", "--set", "validation_num_inference_steps=1"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    root = tmp_path_factory.mktemp("ait-models")
    return {f: write_tiny_model(f, root / f) for f in sorted({family for family, _, _ in EXAMPLES.values()})}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    # large enough for the three resolutions (64, 128, 192) a published resolution list becomes here
    return write_shapes_dataset(
        tmp_path_factory.mktemp("ait-images") / "data", num_images=2, sizes=((288, 192), (192, 192))
    )


@pytest.fixture(scope="module")
def edits(tmp_path_factory):
    """(edited images with their instructions, the sources they were made from): an edit model's dataset."""
    return write_edit_pairs(tmp_path_factory.mktemp("ait-edits"), num_pairs=2, sizes=((288, 192), (192, 192)))


def published(name: str) -> dict[str, Any]:
    return json.loads((PUBLISHED / f"{name}.json").read_text())


def swapped(raw: dict[str, Any], model: Path, images: Path, edits: tuple[Path, Path]) -> dict[str, Any]:
    """The example with its paths pointing at the tiny local model and data, and its sizes at CPU scale: each
    resolution of a list becomes 64, 128, 192..., the sample size 64 x 64. Nothing else changes."""
    raw = copy.deepcopy(raw)
    process = raw["config"]["process"][0]
    process["model"]["name_or_path"] = str(model)
    for dataset in process["datasets"]:
        paired = "control_path" in dataset
        dataset["folder_path"] = str(edits[0] if paired else images)
        if paired:
            dataset["control_path"] = str(edits[1])
        size = dataset["resolution"]
        dataset["resolution"] = [64 * (i + 1) for i in range(len(size))] if isinstance(size, list) else 64
    sample = process["sample"]
    sample.update(width=64, height=64)
    source = str(edits[1] / "000.png")
    sample["prompts"] = [re.sub(r"--ctrl_img \S+", f"--ctrl_img {source}", p) for p in sample.get("prompts", [])]
    for item in sample.get("samples", []):
        item["ctrl_img"] = source
    return raw


def changed(raw: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the dotted keys of its process set (None: removed)."""
    raw = copy.deepcopy(raw)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = raw["config"]["process"][0]
        for part in parents:
            node = node[part]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return raw


def _job(tmp_path: Path, raw: dict[str, Any], name: str = "job.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def _stops_on(error: ConfigError) -> set[str]:
    return {m.group(1) for line in error.problems if (m := re.match(r"`([\w.\[\]]+)", line))}


@pytest.mark.skipif(not MIRROR.is_dir(), reason="no mirror of ostris/ai-toolkit on this machine")
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_recorded_examples_are_ai_toolkits_files_as_it_reads_them(name):
    shown = subprocess.run(
        ["git", "-C", str(MIRROR), "show", f"{AIT_COMMIT}:config/examples/{name}.yaml"], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert parse_job_text(shown.stdout, True, name) == published(name)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_published_examples_translate_or_stop_naming_the_key_and_the_fix_translates(
    tmp_path, models, images, edits, monkeypatch, name
):
    family, stops, fix = EXAMPLES[name]
    monkeypatch.chdir(tmp_path)
    raw = swapped(published(name), models[family], images, edits)
    if stops is not None:
        with pytest.raises(ConfigError) as caught:
            load_config(_job(tmp_path, raw))
        assert _stops_on(caught.value) == set(stops.split()), caught.value.problems
        said = "\n".join(caught.value.problems)
        assert all(str(v) in said for v in fix.values() if v is not None), said  # the message names the fix
        raw = changed(raw, fix)
    config = load_config(_job(tmp_path, raw)).config
    process = raw["config"]["process"][0]
    network, train, sample = process["network"], process["train"], process["sample"]
    assert (config.lora_rank, config.lora_alpha) == (network["linear"], network["linear_alpha"])
    assert config.max_train_steps == train["steps"] and config.learning_rate == train["lr"] == 1e-4
    assert config.optimizer == "bnb-adamw8bit" and config.adam_epsilon == 1e-6  # optimizer.py: eps=1e-6
    assert config.weight_decay == train.get("optimizer_params", {}).get("weight_decay", 0.01)
    assert config.output_dir == str(tmp_path / "output" / raw["config"]["name"])
    assert (config.checkpointing_steps, config.checkpoints_total_limit) == (250, 4)
    assert config.mixed_precision == "bf16" and config.gradient_checkpointing
    # cached text embeddings: ai-toolkit drops no caption (its dropout needs the text encoder at each step)
    assert config.caption_dropout_probability == (0.0 if train.get("cache_text_embeddings") else 0.05)
    sizes = process["datasets"][0]["resolution"]
    assert [d.resolution for d in config.datasets] == (sizes if isinstance(sizes, list) else [sizes])
    assert config.validation_seed == 42 and config.validation_guidance_scale == sample["guidance_scale"]
    assert [p.split("--")[0].strip() for p in sample.get("prompts", [])] == config.validation_prompts[
        : len(sample.get("prompts", []))
    ]
    assert config.validation_num_inference_steps == sample["sample_steps"]
    assert config.use_ema == bool(train.get("ema_config", {}).get("use_ema"))
    quantised = process["model"].get("quantize")
    assert config.base_model_precision == (process["model"].get("qtype", "qfloat8") if quantised else "no_change")
    if any("ctrl_img" in p for p in sample.get("prompts", [])) or sample.get("samples"):
        assert config.validation_image == str(edits[1] / "000.png")
    if "trigger_word" in process:
        assert all(d.instance_prompt == process["trigger_word"] for d in config.datasets)


#: The examples trained end to end here (one step each, as published but for paths, sizes and the stop's fix):
#: Flux (qfloat8 + EMA + a resolution list), Wan 2.1 14B (trigger word with unload_text_encoder, low_vram), Wan 2.2
#: 14B (both experts). The others are read in full above; each trains the same way on those families.
TRAINED = ["train_lora_flux_24gb", "train_lora_wan21_14b_24gb", "train_lora_wan22_14b_24gb"]


@pytest.mark.parametrize("name", TRAINED)
def test_published_examples_train_through_simpletuner_train(tmp_path, models, images, edits, monkeypatch, name):
    family, _, fix = EXAMPLES[name]
    monkeypatch.chdir(tmp_path)
    path = _job(tmp_path, changed(swapped(published(name), models[family], images, edits), fix))
    assert main(["train", "--config", str(path), *ONE_STEP]) == 0
    run = tmp_path / "output" / published(name)["config"]["name"]
    assert list(run.glob("*.safetensors"))  # Wan 2.2: one adapter file per expert
    assert list((run / "validation").glob("step_000001_*.png"))


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


def test_seed_blocks_train_dual_stage_lycoris_on_tiny_wan22(tmp_path, models, images, monkeypatch, capsys):
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
    # fp16 (section 10.3) needs CUDA's grad scaler: on this CPU the run says so before loading anything, and
    # trains in fp32 when told to; the fp16 step itself is the GPU truth script's to check
    assert main(["train", "--config", str(path)]) != 0
    assert "mixed_precision 'fp16' needs a CUDA GPU" in capsys.readouterr().err
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


def test_convert_writes_the_translation_which_trains_the_same_run(tmp_path, models, images, edits, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _job(tmp_path, swapped(published("train_lora_flux_24gb"), models["flux"], images, edits))
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


def test_estimate_reads_an_ai_toolkit_job(tmp_path, models, images, edits, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = _job(tmp_path, swapped(published("train_lora_wan21_1b_24gb"), models["wan"], images, edits))
    assert main(["estimate", "--config", str(path), "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)["estimate"]
    # the job's figures, as translated: wan, bf16, micro-batch 1, gradient checkpointing on
    assert (estimate["model_family"], estimate["mixed_precision"], estimate["micro_batch_size"]) == ("wan", "bf16", 1)
    assert estimate["gradient_checkpointing"] is True
