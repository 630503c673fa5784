"""Config validation: every problem reported at once, with path and fix, before any model loads."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError

from simpletuner.configuration import ConfigError, load_config, validate_config
from simpletuner.configuration.docs import render

ROOT = Path(__file__).resolve().parents[1]


def _problems(raw, **kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(raw, **kw)
    return info.value.problems


def test_minimal_config_is_valid(make_config):
    cfg = validate_config(make_config())
    assert cfg.train_batch_size == 2
    assert cfg.effective_lora_alpha == cfg.lora_rank


def test_every_problem_is_reported_at_once(make_config):
    raw = make_config(lerning_rate=1e-4, mixed_precision="fp8", train_batch_size="four")
    problems = _problems(raw)
    assert len(problems) == 3
    joined = "\n".join(problems)
    assert "lerning_rate: unknown key 'lerning_rate'; did you mean 'learning_rate'?" in joined
    assert "mixed_precision: 'fp8' is not one of no, fp16, bf16" in joined
    assert "train_batch_size:" in joined and "'four'" in joined


def test_nested_paths_and_dataset_type(make_config):
    raw = make_config()
    raw["datasets"] = [
        {"id": "a", "type": "s3", "instance_data_dir": "/x"},
        {"id": "b", "type": "local", "instance_data_dir": "/x", "crop_styl": "center"},
    ]
    problems = _problems(raw, check_files=False)
    assert any(p.startswith("datasets[0].type: 's3' is not one of local") for p in problems)
    assert any(p.startswith("datasets[1].crop_styl: unknown key") and "crop_style" in p for p in problems)


def test_cross_field_rules(make_config):
    raw = make_config(max_train_steps=None, validation_steps=5, resolution=72)
    raw.pop("max_train_steps")
    joined = "\n".join(_problems(raw))
    assert "max_train_steps" in joined and "num_train_epochs" in joined
    assert "validation_prompt" in joined
    assert "not a multiple of `aspect_bucket_alignment` 16" in joined


def test_instance_prompt_strategy_needs_prompt(make_config):
    raw = make_config()
    raw["datasets"][0]["caption_strategy"] = "instance_prompt"
    assert any("instance_prompt" in p for p in _problems(raw))


def test_missing_model_folder_output_file_and_dataset_dir(make_config, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    raw = make_config(pretrained_model_name_or_path=str(tmp_path / "nope"), output_dir=str(blocker))
    raw["datasets"][0]["instance_data_dir"] = str(tmp_path / "missing")
    joined = "\n".join(_problems(raw))
    assert f"{tmp_path / 'nope'} does not exist" in joined
    assert "output_dir" in joined and "is a file" in joined
    assert "datasets[0].instance_data_dir" in joined


def test_model_folder_without_model_index(make_config, tmp_path):
    (tmp_path / "empty_model").mkdir()
    joined = "\n".join(_problems(make_config(pretrained_model_name_or_path=str(tmp_path / "empty_model"))))
    assert "no model_index.json" in joined


def test_load_config_file_with_overrides_and_bad_json(make_config, tmp_path):
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(make_config()))
    loaded = load_config(path, ["max_train_steps=9", 'cache_config.cache_dir="/tmp/x"'])
    assert loaded.config.max_train_steps == 9
    assert loaded.config.cache_config.cache_dir == "/tmp/x"
    assert loaded.raw["max_train_steps"] == 9
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.json")


def test_data_backend_config_file_is_resolved_relative_to_config(make_config, tmp_path, shapes_dir):
    raw = make_config()
    datasets = raw.pop("datasets")
    (tmp_path / "sets.json").write_bytes(orjson.dumps(datasets))
    raw["data_backend_config"] = "sets.json"
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    cfg = load_config(path).config
    assert cfg.datasets[0].instance_data_dir == str(shapes_dir)


def test_config_is_frozen(make_config):
    cfg = validate_config(make_config())
    with pytest.raises(ValidationError, match="frozen"):
        cfg.learning_rate = 1.0


@pytest.mark.parametrize("path", sorted((ROOT / "config" / "examples").glob("*.json")), ids=lambda p: p.name)
def test_every_example_config_loads(path):
    loaded = load_config(path, check_files=False)
    assert loaded.config.datasets, "examples must name at least one dataset"


def test_config_reference_matches_schema():
    doc = (ROOT / "documentation" / "CONFIG.md").read_text()
    assert doc == render(), "documentation/CONFIG.md is stale: run `python -m simpletuner.configuration.docs`"


@pytest.mark.parametrize("name", ["accelerate_config_gh200.yaml", "accelerate_config_gh200_fsdp.yaml"])
def test_accelerate_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(ROOT / "config" / name))
    assert cfg.mixed_precision == "bf16"
    assert cfg.num_machines == 1
