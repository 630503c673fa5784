"""`pretrained_model_name_or_path` follows the rule of every path in a config: a relative one is taken from
the config file's folder; an `org/name` that is not a folder there stays a hub id; a missing one is refused
naming where it was looked for."""

from __future__ import annotations

import shutil

import orjson
import pytest

from simpletuner.configuration import ConfigError, load_config
from simpletuner.state import StateTracker
from simpletuner.training.trainer import Trainer


def _write(folder, raw) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_bytes(orjson.dumps(raw))
    return str(path)


def test_a_relative_model_path_is_taken_from_the_config_folder_and_trains(make_config, tiny_sd, tmp_path, monkeypatch):
    shutil.copytree(tiny_sd, tmp_path / "models" / "tiny-sd")
    raw = make_config(max_train_steps=1, pretrained_model_name_or_path="../models/tiny-sd")
    raw.pop("model_family")  # read from the folder the path names
    config_path = _write(tmp_path / "configs", raw)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # nothing named ../models/tiny-sd from here
    loaded = load_config(config_path)
    assert loaded.config.pretrained_model_name_or_path == str(tmp_path / "models" / "tiny-sd")
    assert loaded.config.model_family == "sd"
    result = Trainer(StateTracker(loaded.config, loaded.raw)).train()
    assert result.global_step == 1


def test_a_hub_id_stays_a_hub_id_unless_the_config_folder_holds_that_folder(
    make_config, tiny_sd, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    config_path = _write(tmp_path / "configs", make_config(pretrained_model_name_or_path="org/name"))
    assert load_config(config_path).config.pretrained_model_name_or_path == "org/name"
    shutil.copytree(tiny_sd, tmp_path / "configs" / "org" / "name")
    assert load_config(config_path).config.pretrained_model_name_or_path == str(tmp_path / "configs" / "org" / "name")


def test_a_missing_relative_model_path_names_the_folders_looked_in(make_config, tiny_sd, tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    config_path = _write(configs, make_config(pretrained_model_name_or_path="tiny-sd"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(config_path)
    text = str(err.value)
    assert f"pretrained_model_name_or_path: {configs / 'tiny-sd'} does not exist" in text
    assert f"'tiny-sd' is taken from the config file's folder {configs}" in text
    assert "working directory" not in text
    shutil.copytree(tiny_sd, tmp_path / "tiny-sd")  # where the old rule (the working directory) found it
    with pytest.raises(ConfigError, match=f"the working directory holds it \\({tmp_path / 'tiny-sd'}\\)"):
        load_config(config_path)
