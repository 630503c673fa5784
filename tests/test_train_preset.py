"""`simpletuner train --preset NAME`: a preset fills what the config and the launch leave unset."""

from __future__ import annotations

import json
import logging

import pytest

from simpletuner.cli.train import main as train_main
from simpletuner.cli.train import prepare_config
from simpletuner.configuration import ConfigError


def _write(tmp_path, raw) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_config_keys_win_and_every_effective_value_is_said(make_config, tmp_path):
    path = _write(tmp_path, make_config(gradient_checkpointing=False))  # sets train_batch_size 2, not the rest
    loaded, sources, notes = prepare_config(path, environ={}, launch_command=None, preset="gb10_sd15_conservative")
    cfg = loaded.config
    assert cfg.mixed_precision == "bf16" and cfg.gradient_accumulation_steps == 8  # from the preset
    assert cfg.cache_config.vae_cache_type == "memory"  # a nested section merged key by key ...
    assert cfg.cache_config.cache_dir == str(tmp_path / "cache")  # ... keeping the config's own keys
    assert cfg.gradient_checkpointing is False and cfg.train_batch_size == 2  # the config wins
    assert sources["mixed_precision"].startswith("from preset gb10_sd15_conservative")
    text = "\n".join(notes)
    assert 'mixed_precision = "bf16"  (preset gb10_sd15_conservative)' in text
    assert "gradient_checkpointing = false  (config; the preset's true not used)" in text


def test_the_launch_beats_the_preset(make_config, tmp_path):
    path = _write(tmp_path, make_config())
    loaded, sources, _ = prepare_config(
        path, environ={"ACCELERATE_MIXED_PRECISION": "no"}, launch_command=None, preset="gb10_sd15_conservative"
    )
    assert loaded.config.mixed_precision == "no"
    assert "ACCELERATE_MIXED_PRECISION" in sources["mixed_precision"]


def test_unknown_and_misfit_presets_stop_before_loading(make_config, tmp_path, capsys):
    path = _write(tmp_path, make_config(learning_rate=-1))
    with pytest.raises(ConfigError) as err:
        prepare_config(path, environ={}, launch_command=None, preset="gb10_turbo")
    text = str(err.value)
    assert "--preset gb10_turbo" in text and "gb10_sd15_optimized" in text  # the known names are listed
    assert "learning_rate" in text  # and the config's own problems in the same pass
    path = _write(tmp_path, make_config())
    assert train_main(["--config", path, "--preset", "gb10_optimized"]) == 2
    err = capsys.readouterr().err
    assert "gb10_optimized" in err and "'wan'" in err and "'sd'" in err


def test_a_run_with_a_preset_logs_what_it_filled(make_config, tmp_path, caplog):
    raw = make_config(max_train_steps=1, train_batch_size=2, mixed_precision="no", gradient_accumulation_steps=1)
    with caplog.at_level(logging.INFO, logger="simpletuner"):
        assert train_main(["--config", _write(tmp_path, raw), "--preset", "gb10_sd15_conservative"]) == 0
    assert "preset gb10_sd15_conservative" in caplog.text
    assert "gradient_checkpointing = true  (preset gb10_sd15_conservative)" in caplog.text
    written = json.loads((tmp_path / "output" / "config.json").read_text())
    assert written["gradient_checkpointing"] is True  # output_dir/config.json records what ran
