"""A tracker whose package is missing stops at config time; relative paths follow the config file."""

from __future__ import annotations

import os
import sys

import orjson
import pytest

from simpletuner.cli.train import main, prepare_config
from simpletuner.configuration import ConfigError, load_config


def _write(path, raw):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(raw))
    return path


# --- trackers ------------------------------------------------------------------------------


@pytest.mark.parametrize("tracker, modules", [("tensorboard", ("tensorboard", "tensorboardX")), ("wandb", ("wandb",))])
def test_missing_tracker_package_stops_with_the_install_command(
    make_config, tmp_path, monkeypatch, capsys, tracker, modules
):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # import fails, as when not installed
    path = _write(tmp_path / "cfg.json", make_config(report_to=tracker))
    code = main(["--config", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"report_to: '{tracker}' needs the {modules[0]} package" in err
    assert f'pip install -e ".[{tracker}]"' in err and 'report_to: "none"' in err
    assert not (tmp_path / "output").exists(), "nothing ran"
    # estimate and the cache tools do not log to a tracker: they still load the config
    assert load_config(path, check_files=False).config.report_to == tracker


def test_installed_tracker_passes(make_config, tmp_path):
    pytest.importorskip("tensorboard")
    path = _write(tmp_path / "cfg.json", make_config(report_to="tensorboard"))
    assert load_config(path).config.report_to == "tensorboard"


# --- relative paths ------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_config_folder(make_config, shapes_dir, tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "data").symlink_to(shapes_dir, target_is_directory=True)
    (project / "out" / "checkpoint-2").mkdir(parents=True)
    raw = make_config(
        output_dir="out",
        cache_config={"cache_dir": "cache"},
        resume_from_checkpoint="out/checkpoint-2",
        datasets=[{"id": "shapes", "type": "local", "instance_data_dir": "data"}],
    )
    path = _write(project / "cfg.json", raw)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # run from another folder: the same places are used

    cfg = load_config(os.path.relpath(path, elsewhere)).config  # a relative --config path too
    assert cfg.output_dir == str(project / "out")
    assert cfg.cache_config.cache_dir == str(project / "cache")
    assert cfg.resume_from_checkpoint == str(project / "out" / "checkpoint-2")
    assert cfg.datasets[0].instance_data_dir == str(project / "data")

    # The entry point, with --set values (relative to the config file as well) and the defaults.
    raw.pop("output_dir"), raw.pop("cache_config"), raw.pop("resume_from_checkpoint")
    _write(path, raw)
    loaded, _, _ = prepare_config(str(path), ["output_dir=runs/a"], environ={}, launch_command=None)
    assert loaded.config.output_dir == str(project / "runs" / "a")
    assert loaded.config.cache_config.cache_dir == str(project / "cache")
    assert load_config(path).config.output_dir == str(project / "output")
    assert not (elsewhere / "output").exists() and not (elsewhere / "cache").exists()


def test_datasets_of_a_data_backend_config_resolve_against_the_config_folder(
    make_config, shapes_dir, tmp_path, monkeypatch
):
    project = tmp_path / "project"
    project.mkdir()
    (project / "data").symlink_to(shapes_dir, target_is_directory=True)
    _write(project / "sets" / "datasets.json", [{"id": "shapes", "type": "local", "instance_data_dir": "data"}])
    raw = make_config(data_backend_config="sets/datasets.json")
    raw.pop("datasets")
    path = _write(project / "cfg.json", raw)
    monkeypatch.chdir(tmp_path)
    assert load_config(path).config.datasets[0].instance_data_dir == str(project / "data")


def test_absolute_and_home_paths_are_kept(make_config, tmp_path):
    raw = make_config(output_dir=str(tmp_path / "abs"), cache_config={"cache_dir": "~/st-cache"})
    cfg = load_config(_write(tmp_path / "cfg" / "c.json", raw), check_files=False).config
    assert cfg.output_dir == str(tmp_path / "abs") and cfg.cache_config.cache_dir == "~/st-cache"


def test_missing_relative_dataset_names_the_resolved_folder(make_config, tmp_path, monkeypatch):
    raw = make_config(datasets=[{"id": "x", "type": "local", "instance_data_dir": "missing"}])
    path = _write(tmp_path / "project" / "cfg.json", raw)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=f"datasets\\[0\\].instance_data_dir: {tmp_path / 'project' / 'missing'} is not a folder"
    ):
        load_config(path)


@pytest.mark.parametrize(
    "settings, module, words",
    [
        ({"optimizer": "prodigy", "learning_rate": 1.0}, "prodigyopt", "optimizer: 'prodigy' needs the prodigyopt"),
        ({"optimizer": "optimi-lion"}, "optimi", "optimizer: 'optimi-lion' needs the torch-optimi package"),
        ({"optimizer": "bnb-adamw8bit"}, "bitsandbytes", "optimizer: 'bnb-adamw8bit' needs the bitsandbytes"),
        ({"lora_type": "lycoris"}, "lycoris", "lora_type: 'lycoris' needs the lycoris-lora package"),
        ({"base_model_precision": "qint8"}, "optimum.quanto", "base_model_precision: 'qint8' needs the optimum-quanto"),
        ({"base_model_precision": "int8_torchao"}, "torchao", "'int8_torchao' needs the torchao package"),
    ],
)
def test_a_missing_optional_package_stops_before_anything_loads(
    make_config, tmp_path, monkeypatch, capsys, settings, module, words
):
    """Not after the cache fill, where the optimizer / adapter / quantisation is built."""
    monkeypatch.setitem(sys.modules, module, None)  # import fails, as when not installed
    path = _write(tmp_path / "cfg.json", make_config(**settings))
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert words in err and "pip install -e" in err
    assert not (tmp_path / "output").exists(), "nothing ran"
