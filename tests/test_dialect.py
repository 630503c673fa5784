"""SimpleTuner's config dialect: the table covers the dialect, translation keeps meaning, bad input stops."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from simpletuner.configuration import load_config
from simpletuner.configuration.docs import render_migrating
from simpletuner.configuration.errors import ConfigError
from simpletuner.configuration.loader import NATIVE_KEYS
from simpletuner.configuration.simpletuner import facts as dialect_values
from simpletuner.configuration.simpletuner import reading as dialect_read
from simpletuner.configuration.simpletuner import translate as dialect

SNAPSHOT = Path(__file__).parent / "data" / "simpletuner_keys.json"
REPO = Path(__file__).resolve().parents[1]


def test_every_key_of_the_dialect_is_in_the_table():
    snapshot = json.loads(SNAPSHOT.read_text())
    missing = [
        f"{section}: {key}"
        for section in ("top", "dataset")
        for key in snapshot[section]
        if dialect.entry_for(key, section) is None
    ]
    assert not missing, f"SimpleTuner keys the dialect table lacks: {missing}"


def test_table_entries_are_unique_and_well_formed():
    seen = set()
    for entry in dialect.DIALECT:
        assert (entry.section, entry.key) not in seen, f"{entry.key} ({entry.section}) is in the table twice"
        seen.add((entry.section, entry.key))
        assert entry.kind in dialect_read.KINDS
        if entry.kind in ("same", "approximated"):
            assert entry.ours or entry.apply, f"{entry.key}: a mapped key must name ours or say how it applies"
        if entry.kind in ("approximated", "ignored", "unsupported"):
            assert entry.note, f"{entry.key}: a {entry.kind} key must say why"


def test_migrating_document_is_generated_from_the_table():
    doc = (REPO / "documentation" / "MIGRATING_FROM_SIMPLETUNER.md").read_text()
    assert doc == render_migrating(), "run `python -m simpletuner.configuration.docs`"


def test_native_configs_are_not_read_as_simpletuner(make_config):
    assert not dialect.looks_like_simpletuner(make_config(), NATIVE_KEYS)
    for path in sorted((REPO / "config").rglob("*.json")):
        raw = json.loads(path.read_text())
        if isinstance(raw, dict):
            assert not dialect.looks_like_simpletuner(raw, NATIVE_KEYS), path


# --- a SimpleTuner project on disk: config/config.json + config/multidatabackend.json ---------
def _project(tmp_path: Path, tiny_sd: Path, shapes_dir: Path, config: dict, datasets: list | None = None) -> Path:
    """A folder laid out as SimpleTuner users have it; returns the config path. Paths in ``config`` and
    ``datasets`` are relative to the project folder (SimpleTuner's working directory)."""
    root = tmp_path / "project"
    (root / "config").mkdir(parents=True)
    (root / "datasets").mkdir()
    (root / "datasets" / "shapes").symlink_to(shapes_dir)
    (root / "models").mkdir()
    (root / "models" / "sd").symlink_to(tiny_sd)
    if datasets is None:
        datasets = [
            {
                "id": "shapes",
                "type": "local",
                "instance_data_dir": "datasets/shapes",
                "caption_strategy": "textfile",
                "resolution": 64,
                "resolution_type": "pixel_area",
                "crop": True,
                "crop_aspect": "preserve",
                "crop_style": "center",
                "cache_dir_vae": "cache/vae/{model_family}/shapes",
            },
            {
                "id": "text",
                "dataset_type": "text_embeds",
                "default": True,
                "type": "local",
                "cache_dir": "cache/text/{model_family}",
            },
        ]
    (root / "config" / "multidatabackend.json").write_text(json.dumps(datasets))
    base = {
        "--model_family": "sd1x",
        "--model_type": "lora",
        "--pretrained_model_name_or_path": "models/sd",
        "--data_backend_config": "config/multidatabackend.json",
        "--output_dir": "output/models",
        "--resolution": 64,
        "--aspect_bucket_alignment": 16,
        "--max_train_steps": 2,
        "--num_train_epochs": 0,
        "--train_batch_size": 2,
        "--learning_rate": "1e-3",
        "--seed": 7,
        "--gradient_checkpointing": "false",
        "--mixed_precision": "no",
        "--optimizer": "optimi-adamw",
        "--push_to_hub": "false",
        "--report_to": "none",
    }
    base.update(config)
    path = root / "config" / "config.json"
    path.write_text(json.dumps(base))
    return path


def test_a_missing_relative_model_folder_is_looked_for_in_the_working_directory(
    tmp_path, tiny_sd, shapes_dir, monkeypatch
):
    """SimpleTuner reads a relative model path from the working directory: the refusal names that folder,
    not the config file's (where a native config's relative paths are read)."""
    path = _project(tmp_path, tiny_sd, shapes_dir, {"--pretrained_model_name_or_path": "models/gone/sd"})
    root = path.parent.parent
    monkeypatch.chdir(root)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(root / "models" / "gone" / "sd") in str(raised.value)


def test_a_dashed_config_with_string_values_loads_with_its_meaning(tmp_path, tiny_sd, shapes_dir, monkeypatch, caplog):
    path = _project(tmp_path, tiny_sd, shapes_dir, {"--checkpoint_step_interval": "5", "--lora_rank": "4"})
    root = path.parent.parent
    monkeypatch.chdir(root)
    with caplog.at_level(logging.INFO, logger="simpletuner.configuration.loader"):
        config = load_config(path).config
    assert config.model_family == "sd" and config.training_type == "lora"
    assert config.pretrained_model_name_or_path == str(root / "models" / "sd")
    assert config.output_dir == str(root / "output" / "models")  # the working directory, as SimpleTuner
    assert config.learning_rate == 1e-3 and config.checkpointing_steps == 5 and config.lora_rank == 4
    # SimpleTuner's config reader skips the string "false" (cli_utils.py:223-226): its default, on, stays
    assert config.gradient_checkpointing is True and config.num_train_epochs is None
    forced = [r.getMessage() for r in caplog.records if "SimpleTuner setting forced" in r.getMessage()]
    assert any('`gradient_checkpointing: "false"` (a string) -> true' in line for line in forced)
    assert config.optimizer == "optimi-adamw"  # optimi's AdamW, as SimpleTuner builds it
    # SimpleTuner's defaults where the config is silent and ours differ
    assert config.max_grad_norm == 2.0 and config.grad_clip_method == "value" and config.lora_dropout == 0.1
    (ds,) = config.datasets
    assert ds.instance_data_dir == str(root / "datasets" / "shapes")
    assert ds.cache_dir_vae == str(root / "cache" / "vae" / "sd1x" / "shapes")  # SimpleTuner's family name
    assert config.cache_config.text_cache_dir == str(root / "cache" / "text" / "sd1x")
    assert (ds.crop, ds.crop_aspect, ds.crop_style, ds.resolution_type) == (True, "preserve", "center", "pixel_area")
    summary = [r.getMessage() for r in caplog.records if "read as a SimpleTuner config" in r.getMessage()]
    assert len(summary) == 1 and "keys mapped" in summary[0]


def test_data_backend_config_is_found_from_the_working_directory_then_beside_the_config(
    tmp_path, tiny_sd, shapes_dir, monkeypatch
):
    path = _project(tmp_path, tiny_sd, shapes_dir, {"--data_backend_config": "multidatabackend.json"})
    monkeypatch.chdir(path.parent.parent)  # not in the working directory: found beside config.json
    assert load_config(path, check_files=False).config.datasets[0].id == "shapes"
    (path.parent.parent / "multidatabackend.json").write_text(
        json.dumps([{"id": "from-cwd", "type": "local", "instance_data_dir": "datasets/shapes"}])
    )
    dialect_raw = json.loads(path.read_text())
    native, _ = dialect.translate(dialect_raw, path)
    assert [d["id"] for d in native["datasets"]] == ["from-cwd"]  # the working directory first


def test_unsupported_keys_stop_with_the_key_and_the_fix_and_off_switches_do_not(
    tmp_path, tiny_sd, shapes_dir, monkeypatch
):
    path = _project(
        tmp_path,
        tiny_sd,
        shapes_dir,
        {
            "distillation_method": "dcm",
            "controlnet": False,
            "--lr_scale": "true",
        },
    )
    monkeypatch.chdir(path.parent.parent)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert "lr_scale" in text and "multiply `learning_rate` yourself" in text
    assert "distillation_method" in text
    assert "controlnet" not in text  # `false`: nothing to refuse


def test_two_keys_for_one_setting_with_different_values_stop(tmp_path, tiny_sd, shapes_dir, monkeypatch):
    path = _project(tmp_path, tiny_sd, shapes_dir, {"checkpoint_step_interval": 50, "checkpointing_steps": 100})
    monkeypatch.chdir(path.parent.parent)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "checkpoint_step_interval" in str(err.value) and "checkpointing_steps" in str(err.value)
    path.write_text(json.dumps({**json.loads(path.read_text()), "checkpointing_steps": 50}))
    assert load_config(path).config.checkpointing_steps == 50  # the same value twice is fine
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "seed": 8}))  # `--seed: 7` and `seed: 8`
    with pytest.raises(ConfigError, match="seed"):
        load_config(path)


def test_model_flavour_without_a_path_is_its_hub_model_and_offline_says_what_to_download(
    tmp_path, tiny_sd, shapes_dir, monkeypatch
):
    """SimpleTuner loads a flavour's hub model when no path is given; so does the translation. Offline with an
    empty Hub cache, `train` stops before loading, naming the repo and the download command."""
    from simpletuner.cli.train import prepare_config

    path = _project(tmp_path, tiny_sd, shapes_dir, {"model_flavour": "dreamshaper"})
    raw = json.loads(path.read_text())
    del raw["--pretrained_model_name_or_path"]
    path.write_text(json.dumps(raw))
    monkeypatch.chdir(path.parent.parent)
    native, _ = dialect.translate(raw, path, path.parent.parent)
    assert native["pretrained_model_name_or_path"] == "Lykon/dreamshaper-8"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as err:
        prepare_config(str(path), launch_command=None)
    assert "Lykon/dreamshaper-8 is not in the Hub cache" in str(err.value)
    assert "hf download Lykon/dreamshaper-8" in str(err.value)


def test_wan22_flavours_pick_the_stage_or_stop_naming_what_is_missing(tmp_path, monkeypatch):
    base = {"model_family": "wan", "pretrained_model_name_or_path": str(tmp_path)}
    native, _ = dialect.translate({**base, "model_flavour": "i2v-14b-2.2-high"}, None, tmp_path)
    assert native["train_stages"] == "high" and "ti2v_first_frame" not in native
    native, _ = dialect.translate({**base, "model_flavour": "ti2v-5b-2.2"}, None, tmp_path)
    assert native["ti2v_first_frame"] is True and "train_stages" not in native
    for wan21_i2v in ("i2v-14b-2.1", "i2v-14b-2.1-720p"):
        with pytest.raises(dialect.DialectError, match="Wan 2.1 image-to-video"):
            dialect.translate({**base, "model_flavour": wan21_i2v}, None, tmp_path)
    with pytest.raises(dialect.DialectError, match="AnimeGen"):
        dialect.translate({**base, "model_flavour": "animegen-t2v-low"}, None, tmp_path)
    # a text-to-video A14B flavour (none is published yet) would train its one expert
    monkeypatch.setitem(dialect_values.FLAVOURS["wan"], "t2v-a14b-2.2-high", "Wan-AI/Wan2.2-T2V-A14B-Diffusers")
    native, _ = dialect.translate({**base, "model_flavour": "t2v-a14b-2.2-high"}, None, tmp_path)
    assert native["train_stages"] == "high"


def test_num_train_epochs_zero_means_max_train_steps(tmp_path):
    native, report = dialect.translate(
        {
            "model_type": "lora",
            "num_train_epochs": 0,
            "max_train_steps": 10,
            "pretrained_model_name_or_path": str(tmp_path),
        },
        None,
        tmp_path,
    )
    assert "num_train_epochs" not in native and native["max_train_steps"] == 10
    native, _ = dialect.translate(
        {
            "model_type": "lora",
            "num_train_epochs": "3",
            "max_train_steps": 0,
            "pretrained_model_name_or_path": str(tmp_path),
        },
        None,
        tmp_path,
    )
    assert native["num_train_epochs"] == 3 and "max_train_steps" not in native


def test_flow_families_get_simpletuners_sigmoid_schedule(tmp_path):
    base = {"model_type": "lora", "pretrained_model_name_or_path": str(tmp_path)}
    native, _ = dialect.translate({**base, "model_family": "flux", "flow_sigmoid_scale": 1.5}, None, tmp_path)
    assert (native["timestep_sampling"], native["logit_mean"], native["logit_std"]) == ("logit_normal", 0.0, 1.5)
    assert native["flow_shift"] == 3.0  # SimpleTuner's default flow_schedule_shift
    native, _ = dialect.translate({**base, "model_family": "sd3", "flow_use_uniform_schedule": "true"}, None, tmp_path)
    assert native["timestep_sampling"] == "uniform"
    native, _ = dialect.translate({**base, "model_family": "sdxl"}, None, tmp_path)
    assert "timestep_sampling" not in native and "flow_shift" not in native


def _lora_file(output_dir: Path) -> dict:
    from safetensors.torch import load_file

    (found,) = output_dir.glob("*.safetensors")
    return load_file(found)


def test_convert_writes_the_same_run(tmp_path, tiny_sd, shapes_dir, monkeypatch, capsys):
    from training_helpers import same_weights

    from simpletuner.cli import main

    path = _project(tmp_path, tiny_sd, shapes_dir, {"--lora_rank": 4})
    root = path.parent.parent
    monkeypatch.chdir(root)
    assert main(["convert", str(path), "--out", "native.json"]) == 0
    err = capsys.readouterr().err
    assert "read as a SimpleTuner config" in err and "wrote native.json" in err
    native = json.loads((root / "native.json").read_text())
    assert not dialect.looks_like_simpletuner(native, NATIVE_KEYS)
    assert native["datasets"][0]["instance_data_dir"] == str(root / "datasets" / "shapes")
    assert main(["convert", str(path), "--out", "native.json"]) == 2  # no silent overwrite
    assert "--force" in capsys.readouterr().err

    assert main(["train", "--config", str(path)]) == 0
    monkeypatch.chdir(tmp_path)  # the converted file does not depend on the working directory
    assert main(["train", "--config", str(root / "native.json"), "--set", f"output_dir={tmp_path / 'out2'}"]) == 0
    assert same_weights(_lora_file(root / "output" / "models"), _lora_file(tmp_path / "out2"))
