"""Presets: every one loads, validates merged into a config of its model family, explains each of
its settings and says which workload it was made for; presets apply to a config (the config's own
keys win), from Python and through `simpletuner estimate --preset NAME --config cfg.json --apply`."""

from __future__ import annotations

import json

import pytest

from simpletuner.cli import main
from simpletuner.configuration import validate_config
from simpletuner.hardware.gpus import resolve_gpu_name
from simpletuner.memory.presets import (
    PRESETS_DIR,
    apply_preset,
    compare_with_preset,
    explain_preset,
    flatten_settings,
    load_preset,
    merge_settings,
    preset_names,
)

EXPECTED = {
    "gb10_conservative",
    "gb10_optimized",
    "gb10_experimental",
    "gh200",
    "gb10_sd15_conservative",
    "gb10_sd15_optimized",
    "gb10_sd15_experimental",
    "discrete_24gb",
    "discrete_32gb",
    "discrete_40gb",
    "discrete_80gb",
}
#: What each preset's description must name: the model its values were chosen for.
WORKLOAD_WORDS = {"wan": "Wan 2.2", "sd": "SD 1.5"}


def test_the_issue_presets_exist():
    assert EXPECTED <= set(preset_names())


@pytest.fixture(scope="module")
def tiny_wan22(tmp_path_factory):
    """A Wan 2.2 folder: a config naming model_family wan must point at one (the folder is checked)."""
    from simpletuner.testing.zoo import write_tiny_model

    return str(write_tiny_model("wan22", tmp_path_factory.mktemp("tiny_wan22") / "model"))


@pytest.mark.parametrize("name", preset_names(), ids=str)
def test_every_preset_loads_and_validates(name, make_config, tiny_sd, tiny_wan22):
    preset = load_preset(name)
    assert WORKLOAD_WORDS[preset.model_family] in preset.workload, "every preset says which workload it was made for"
    assert WORKLOAD_WORDS[preset.model_family] in preset.description
    model = tiny_wan22 if preset.model_family == "wan" else str(tiny_sd)
    raw = merge_settings(
        make_config(model_family=preset.model_family, pretrained_model_name_or_path=model), preset.settings
    )
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
    assert f"made for: {preset.workload}" in " ".join(lines.split())
    for key, reason in preset.why.items():
        assert f"{key} = " in lines and reason.split()[0] in lines


def test_merge_updates_nested_sections_key_by_key(make_config):
    raw = make_config()
    merged = merge_settings(raw, {"cache_config": {"vae_cache_type": "memory"}, "train_batch_size": 8})
    assert merged["cache_config"] == {**raw["cache_config"], "vae_cache_type": "memory"}
    assert merged["train_batch_size"] == 8 and raw["train_batch_size"] == 2  # the input is not changed
    assert flatten_settings(
        {"cuda_allocator": {"expandable_segments": True}, "cache_config": {"vae_cache_type": "disk"}}
    ) == {"cuda_allocator": {"expandable_segments": True}, "cache_config.vae_cache_type": "disk"}


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
    (tmp_path / "gh200.json").write_text(json.dumps({k: v for k, v in good.items() if k != "workload"}))
    with pytest.raises(ValueError, match="missing key 'workload'"):  # every preset says what it was made for
        load_preset("gh200", tmp_path)
    (tmp_path / "gh200.json").write_text(json.dumps({**good, "model_family": "sd15"}))
    with pytest.raises(ValueError, match="model_family 'sd15' is not one of sd, sdxl"):
        load_preset("gh200", tmp_path)


@pytest.mark.parametrize(
    "name, micro_batch, accumulation, low_vram, text_cache",
    [
        ("gb10_conservative", 1, 4, True, "disk"),
        ("gb10_optimized", 1, 8, False, "disk"),
        ("gb10_experimental", 2, 4, False, "memory"),
    ],
)
def test_gb10_presets_carry_the_guides_values_for_wan22(name, micro_batch, accumulation, low_vram, text_cache):
    """The GB10 guide's three Wan 2.2 T2V A14B LoRA configs (original, optimized, experimental)."""
    preset = load_preset(name)
    assert preset.model_family == "wan" and "Wan 2.2 T2V A14B" in preset.workload and preset.gpu == "gb10"
    flat = preset.flat_settings()
    assert flat["train_batch_size"] == micro_batch and flat["gradient_accumulation_steps"] == accumulation
    assert flat["base_model_precision"] == "qfloat8" and flat["gradient_checkpointing"] is True
    assert flat["dataloader_num_workers"] == 0 and flat["low_vram"] is low_vram
    assert flat["cache_config.vae_cache_type"] == "disk"  # the guide's cache_latents_to_disk
    assert flat["cache_config.text_cache_type"] == text_cache
    assert "always caches" in preset.why["cache_config.text_cache_type"]  # says why there is no "off"


def test_sd15_gb10_presets_keep_their_values_under_names_that_say_so():
    assert {
        p: load_preset(p).model_family
        for p in ("gb10_sd15_conservative", "gb10_sd15_optimized", "gb10_sd15_experimental")
    } == dict.fromkeys(("gb10_sd15_conservative", "gb10_sd15_optimized", "gb10_sd15_experimental"), "sd")
    assert load_preset("gb10_sd15_conservative").settings["train_batch_size"] == 2
    assert load_preset("gb10_sd15_optimized").settings["train_batch_size"] == 8
    assert load_preset("gb10_sd15_experimental").settings["gh200_optimizations"]["target_effective_batch_size"] == 64


def test_apply_preset_keeps_what_the_config_sets_and_says_where_each_value_came_from(make_config, tiny_wan22):
    raw = make_config(
        model_family="wan",
        pretrained_model_name_or_path=tiny_wan22,
        train_batch_size=3,
        low_vram=False,
        cache_config={"cache_dir": "/tmp/c", "text_cache_type": "memory"},
    )
    before = json.loads(json.dumps(raw))
    merged, lines = apply_preset(raw, "gb10_conservative")
    assert raw == before, "the input is not changed"
    assert merged["train_batch_size"] == 3 and merged["low_vram"] is False  # set in the config: kept
    assert merged["gradient_accumulation_steps"] == 4 and merged["base_model_precision"] == "qfloat8"  # from the preset
    # nested sections merge key by key: the config's cache_dir and text_cache_type, the preset's vae_cache_type
    assert merged["cache_config"] == {"cache_dir": "/tmp/c", "text_cache_type": "memory", "vae_cache_type": "disk"}
    assert {k: merged[k] for k in raw if k not in ("train_batch_size", "low_vram", "cache_config")} == {
        k: v for k, v in raw.items() if k not in ("train_batch_size", "low_vram", "cache_config")
    }
    text = "\n".join(lines)
    assert "train_batch_size = 3  (config; the preset's 1 not used)" in text
    assert "gradient_accumulation_steps = 4  (preset gb10_conservative)" in text
    assert 'cache_config.vae_cache_type = "disk"  (preset gb10_conservative)' in text
    assert 'cache_config.text_cache_type = "memory"  (config; the preset\'s "disk" not used)' in text
    assert "low_vram = false  (config; the preset's true not used)" in text
    assert lines[0].startswith("preset gb10_conservative") and "Wan 2.2 T2V A14B" in lines[0]
    validate_config(merged)  # what comes out is a valid config


def test_apply_preset_refuses_an_unknown_name_and_another_model_family(make_config, tmp_path):
    with pytest.raises(
        ValueError, match="unknown preset 'gb10_fast': known presets are .*gb10_conservative.*--list-presets"
    ):
        apply_preset(make_config(model_family="wan"), "gb10_fast")
    with pytest.raises(ValueError) as info:
        apply_preset(make_config(model_family="sdxl"), "gb10_optimized")
    message = str(info.value)
    assert "'gb10_optimized' was made for Wan 2.2 T2V A14B" in message and "model_family 'wan'" in message
    assert "trains model_family 'sdxl'" in message and "no preset here is made for 'sdxl'" in message
    assert "--target-effective-batch" in message
    raw = make_config(model_family="wan")
    del raw["model_family"]  # the schema's default, sd: named as the default
    with pytest.raises(
        ValueError, match=r"model_family 'sd' \(the default.*use a preset made for 'sd' \(discrete_24gb"
    ):
        apply_preset(raw, "gb10_optimized")
    (tmp_path / "mine.json").write_text((PRESETS_DIR / "gh200.json").read_text().replace('"gh200"', '"mine"', 1))
    raw = make_config()
    del raw["train_batch_size"]
    assert apply_preset(raw, "mine", tmp_path)[0]["train_batch_size"] == 16  # a preset from another directory


def test_compare_marks_defaults_and_differences(make_config):
    preset = load_preset("gb10_sd15_conservative")
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

    assert all(f"made for: {load_preset(name).workload}" in out for name in EXPECTED)

    assert main(["estimate", "--preset", "gb10_conservative"]) == 0
    out = capsys.readouterr().out
    assert (
        "dataloader_num_workers = 0" in out and 'base_model_precision = "qfloat8"' in out and "low_vram = true" in out
    )
    assert "made for: Wan 2.2 T2V A14B" in out and "--gpu gb10" in out

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(make_config()))
    assert main(["estimate", "--preset", "discrete_24gb", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "train_batch_size: config 2, preset 4" in out and "--set train_batch_size=4" in out

    assert main(["estimate", "--preset", "discrete_24gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["train_batch_size"] == 4

    assert main(["estimate", "--preset", "discrete_24gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_family"] == "sd"

    assert main(["estimate", "--preset", "gb10_optimized", "--config", str(path)]) == 0  # comparing is allowed
    assert "note: preset 'gb10_optimized' was made for Wan 2.2" in capsys.readouterr().out

    assert main(["estimate", "--preset", "rtx"]) == 2
    assert "known presets are" in capsys.readouterr().err


def _wan_config_file(tmp_path, make_config, model):
    raw = make_config(
        model_family="wan",
        pretrained_model_name_or_path=model,
        train_batch_size=2,
        cache_config={"cache_dir": "cache/wan"},
    )
    path = tmp_path / "wan.json"
    path.write_text(json.dumps(raw, indent=2) + "\n")
    return path, raw


def test_cli_apply_writes_the_preset_into_the_config(tmp_path, capsys, make_config, tiny_wan22):
    path, raw = _wan_config_file(tmp_path, make_config, tiny_wan22)
    original = path.read_text()
    assert main(["estimate", "--preset", "gb10_experimental", "--config", str(path), "--apply"]) == 0
    out = capsys.readouterr().out
    written = json.loads(path.read_text())
    assert path.with_name("wan.json.backup").read_text() == original
    assert written["train_batch_size"] == 2  # the config's own value wins
    assert written["gradient_accumulation_steps"] == 4 and written["base_model_precision"] == "qfloat8"
    assert written["low_vram"] is False and written["dataloader_num_workers"] == 0
    assert written["cache_config"] == {
        "cache_dir": "cache/wan",
        "vae_cache_type": "disk",
        "text_cache_type": "memory",
        "persistent_cache": True,
    }
    assert {k: v for k, v in written.items() if k in raw} == {**raw, "cache_config": written["cache_config"]}
    assert "train_batch_size = 2  (config; the same as the preset)" in out
    assert "gradient_accumulation_steps = 4  (preset gb10_experimental)" in out
    assert "--apply: wrote" in out and '+  "base_model_precision": "qfloat8"' in out
    validate_config(written)

    assert main(["estimate", "--preset", "gb10_experimental", "--config", str(path), "--apply"]) == 0
    assert "nothing written" in capsys.readouterr().out
    assert not path.with_name("wan.json.backup.1").exists()


def test_cli_apply_refuses_bad_presets_before_touching_the_file(tmp_path, capsys, make_config, tiny_wan22):
    path, _ = _wan_config_file(tmp_path, make_config, tiny_wan22)
    sd = tmp_path / "sd.json"
    sd.write_text(json.dumps(make_config()))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert main(["estimate", "--preset", "gb10_optimized", "--config", str(sd), "--apply"]) == 2
    err = capsys.readouterr().err
    assert "'gb10_optimized' was made for Wan 2.2" in err and "trains model_family 'sd'" in err
    assert main(["estimate", "--preset", "nope", "--config", str(path), "--apply"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert (
        main(["estimate", "--preset", "gb10_optimized", "--config", str(path), "--apply", "--set", "low_vram=true"])
        == 2
    )
    assert "--set changes would not be written" in capsys.readouterr().err
    assert main(["estimate", "--preset", "gb10_optimized", "--apply"]) == 2
    assert "add --config" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before  # nothing written
