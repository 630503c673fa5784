"""Presets: every one loads, validates merged into a config, and explains each of its settings."""

from __future__ import annotations

import json

import pytest

from simpletuner.cli import main
from simpletuner.configuration import validate_config
from simpletuner.memory.hardware import resolve_gpu_name
from simpletuner.memory.presets import (
    PRESETS_DIR,
    compare_with_preset,
    explain_preset,
    flatten_settings,
    load_preset,
    merge_settings,
    preset_names,
)

EXPECTED = {"gb10_conservative", "gb10_optimized", "gb10_experimental", "gh200",
            "discrete_24gb", "discrete_32gb", "discrete_40gb", "discrete_80gb"}


def test_the_issue_presets_exist():
    assert EXPECTED <= set(preset_names())


@pytest.mark.parametrize("name", preset_names(), ids=str)
def test_every_preset_loads_and_validates(name, make_config):
    preset = load_preset(name)
    raw = merge_settings(make_config(), preset.settings)
    config = validate_config(raw)
    for key, value in preset.flat_settings().items():  # every setting is a real key, applied as written
        current = config
        for part in key.split("."):
            current = getattr(current, part)
        assert current == value, key
    assert preset.gpu is not None or preset.gpu_memory_gb is not None
    if preset.gpu:
        resolve_gpu_name(preset.gpu)
    lines = "\n".join(explain_preset(preset))
    for key, reason in preset.why.items():
        assert f"{key} = " in lines and reason.split()[0] in lines


def test_merge_updates_nested_sections_key_by_key(make_config):
    raw = make_config()
    merged = merge_settings(raw, {"cache_config": {"vae_cache_type": "memory"}, "train_batch_size": 8})
    assert merged["cache_config"] == {**raw["cache_config"], "vae_cache_type": "memory"}
    assert merged["train_batch_size"] == 8 and raw["train_batch_size"] == 2  # the input is not changed
    assert flatten_settings({"cuda_allocator": {"expandable_segments": True}, "cache_config": {"vae_cache_type": "disk"}}) == {
        "cuda_allocator": {"expandable_segments": True}, "cache_config.vae_cache_type": "disk"}


def test_bad_presets_are_refused(tmp_path):
    good = json.loads((PRESETS_DIR / "gh200.json").read_text())
    (tmp_path / "gh200.json").write_text(json.dumps({**good, "why": {}}))
    with pytest.raises(ValueError, match="'train_batch_size' has no reason"):
        load_preset("gh200", tmp_path)
    (tmp_path / "other.json").write_text(json.dumps({**good, "name": "gh200"}))
    with pytest.raises(ValueError, match="differs from the file name"):
        load_preset("other", tmp_path)
    with pytest.raises(ValueError, match="unknown preset 'nope': known presets are gh200, other"):
        load_preset("nope", tmp_path)


def test_compare_marks_defaults_and_differences(make_config):
    preset = load_preset("gb10_conservative")
    raw = make_config(gradient_checkpointing=True, train_batch_size=2)
    differences = {d.key: d for d in compare_with_preset(preset, validate_config(raw), raw)}
    assert differences["gradient_checkpointing"].is_same
    assert differences["train_batch_size"].is_same and not differences["train_batch_size"].is_default
    vae = differences["cache_config.vae_cache_type"]
    assert (vae.config_value, vae.preset_value, vae.is_same, vae.is_default) == ("disk", "memory", False, True)


def test_cli_lists_explains_and_compares(tmp_path, capsys, make_config):
    assert main(["estimate", "--list-presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in EXPECTED)

    assert main(["estimate", "--preset", "gb10_conservative"]) == 0
    out = capsys.readouterr().out
    assert "dataloader_num_workers = 0" in out and "cache_config.vae_cache_type = \"memory\"" in out
    assert "--gpu gb10" in out

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(make_config()))
    assert main(["estimate", "--preset", "discrete_24gb", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "train_batch_size: config 2, preset 4" in out and "--set train_batch_size=4" in out

    assert main(["estimate", "--preset", "discrete_24gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["train_batch_size"] == 4

    assert main(["estimate", "--preset", "rtx"]) == 2
    assert "known presets are" in capsys.readouterr().err
