"""The model folder's pipeline class decides model_family, or contradicts it before any data is read."""

from __future__ import annotations

import shutil

import orjson
import pytest

from simpletuner.cli.train import main, prepare_config
from simpletuner.configuration import ConfigError, TrainingConfig, load_config, validate_config


@pytest.fixture(scope="module")
def tiny_sdxl(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    return write_tiny_model("sdxl", tmp_path_factory.mktemp("tiny_sdxl") / "model")


def _write(path, raw):
    path.write_bytes(orjson.dumps(raw))
    return path


def test_family_contradicting_the_folder_stops_at_config_time_with_the_fix(make_config, tiny_sd, tmp_path, capsys):
    # The dataset folder does not exist: the family is refused without scanning (or needing) any data.
    raw = make_config(
        model_family="sdxl", datasets=[{"id": "x", "type": "local", "instance_data_dir": str(tmp_path / "none")}]
    )
    with pytest.raises(ConfigError) as info:
        validate_config(raw, check_files=False)
    (line,) = [p for p in info.value.problems if p.startswith("model_family:")]
    assert "'sdxl'" in line and "StableDiffusionPipeline" in line and str(tiny_sd / "model_index.json") in line
    assert 'set `model_family: "sd"`' in line and "remove `model_family`" in line

    # The entry point: exit 2 and the message, not "tokenizer_2 does not exist" after caching.
    code = main(["--config", str(_write(tmp_path / "cfg.json", raw))])
    err = capsys.readouterr().err
    assert code == 2 and "names StableDiffusionPipeline, a 'sd' pipeline" in err and "tokenizer_2" not in err


def test_omitted_family_is_taken_from_the_folder_everywhere(make_config, tiny_sdxl, tmp_path):
    raw = make_config(pretrained_model_name_or_path=str(tiny_sdxl))
    raw.pop("model_family")
    path = _write(tmp_path / "cfg.json", raw)
    loaded = load_config(path, check_files=False)  # as estimate and the cache tools load it
    assert loaded.config.model_family == "sdxl"
    assert loaded.raw["model_family"] == "sdxl"  # recorded (output_dir/config.json, trackers)
    assert "model_family" not in orjson.loads(path.read_bytes())  # the user's file is untouched
    trained, _, _ = prepare_config(str(path), environ={}, launch_command=None)
    assert trained.config.model_family == "sdxl" and trained.raw["model_family"] == "sdxl"


def test_omitted_family_is_logged_with_its_source(make_config, tiny_sd, caplog):
    raw = make_config()
    raw.pop("model_family")
    with caplog.at_level("INFO", logger="simpletuner"):
        assert validate_config(raw, check_files=False).model_family == "sd"
    assert f"model_family 'sd' taken from {tiny_sd / 'model_index.json'}" in caplog.text


def test_omitted_family_with_a_hub_id_is_sd(make_config):
    raw = make_config(pretrained_model_name_or_path="org/some-model")
    raw.pop("model_family")
    assert validate_config(raw, check_files=False).model_family == "sd"


def test_unknown_pipeline_class_needs_an_explicit_family(make_config, tiny_sd, tmp_path):
    folder = tmp_path / "inpaint"
    shutil.copytree(tiny_sd, folder)
    index = orjson.loads((folder / "model_index.json").read_bytes())
    (folder / "model_index.json").write_bytes(orjson.dumps({**index, "_class_name": "StableDiffusionInpaintPipeline"}))
    raw = make_config(pretrained_model_name_or_path=str(folder))
    raw.pop("model_family")
    with pytest.raises(ConfigError) as info:
        validate_config(raw, check_files=False)
    assert info.value.problems == [p for p in info.value.problems if p.startswith("model_family:")]
    assert "StableDiffusionInpaintPipeline" in info.value.problems[0] and "set `model_family`" in info.value.problems[0]
    # Named by the user, the family is theirs to choose for a class we do not know.
    assert validate_config(dict(raw, model_family="sd"), check_files=False).model_family == "sd"


def test_bare_schema_without_family_is_refused(make_config):
    raw = make_config()
    raw.pop("model_family")
    with pytest.raises(ValueError, match="model_family"):
        TrainingConfig.model_validate(raw)


@pytest.mark.parametrize("zoo_name, family", [("sd3", "sd3"), ("flux", "flux"), ("wan", "wan"), ("wan22", "wan")])
def test_every_zoo_folder_names_its_family(make_config, tmp_path, zoo_name, family):
    from simpletuner.testing.zoo import write_tiny_model

    raw = make_config(pretrained_model_name_or_path=str(write_tiny_model(zoo_name, tmp_path / zoo_name)))
    raw.pop("model_family")
    assert validate_config(raw, check_files=False).model_family == family
    with pytest.raises(ConfigError, match=f"a '{family}' pipeline"):
        validate_config(dict(raw, model_family="sd"), check_files=False)
