"""Keys both `accelerate launch` and the JSON can set: the launcher's value when the JSON is
silent, a stop naming both when they differ, never a silent winner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simpletuner.cli.train import prepare_config
from simpletuner.configuration import ConfigError
from simpletuner.configuration.launcher import (
    find_launch_command,
    parse_launch_command,
    resolve_launcher_settings,
)

REPO = Path(__file__).resolve().parents[1]
GH200_YAML = REPO / "config" / "accelerate_config_gh200.yaml"


@pytest.fixture
def no_default_accelerate_config(tmp_path):
    """An HF_HOME without `accelerate config`'s default file, so the user's own never leaks in."""
    return {"HF_HOME": str(tmp_path / "hf")}


def _command(args, env):
    return parse_launch_command([*args, "simpletuner/train.py", "--config", "cfg.json"], env)


def test_launcher_precision_fills_an_unset_key(no_default_accelerate_config):
    env = {**no_default_accelerate_config, "ACCELERATE_MIXED_PRECISION": "bf16"}
    out = resolve_launcher_settings({}, env, _command(["--config_file", str(GH200_YAML)], env), "cfg.json")
    assert out.overrides == ['mixed_precision="bf16"']
    assert out.settings["mixed_precision"].value == "bf16"
    assert str(GH200_YAML) in out.settings["mixed_precision"].source


def test_launcher_flag_conflict_names_both_values_and_sources(no_default_accelerate_config):
    env = {**no_default_accelerate_config, "ACCELERATE_MIXED_PRECISION": "fp16"}
    with pytest.raises(ConfigError) as err:
        resolve_launcher_settings(
            {"mixed_precision": "bf16"}, env, _command(["--mixed_precision", "fp16"], env), "cfg.json"
        )
    (problem,) = err.value.problems
    assert "cfg.json says 'bf16'" in problem
    assert "`accelerate launch --mixed_precision fp16` says 'fp16'" in problem
    assert "remove `mixed_precision` from the config" in problem


def test_launcher_default_is_not_a_request(no_default_accelerate_config):
    """`accelerate launch` told nothing writes mixed_precision=no; the JSON's bf16 stands, and says so."""
    env = {**no_default_accelerate_config, "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO"}
    out = resolve_launcher_settings(
        {"mixed_precision": "bf16", "enable_compile": True}, env, _command([], env), "cfg.json"
    )
    assert out.overrides == []
    assert out.settings["mixed_precision"].source == "from cfg.json"


def test_accelerate_default_config_file_counts_as_a_request(tmp_path):
    home = tmp_path / "hf"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text("mixed_precision: fp16\ndistributed_type: 'NO'\n")
    env = {"HF_HOME": str(home), "ACCELERATE_MIXED_PRECISION": "fp16"}
    with pytest.raises(ConfigError, match="Accelerate's default config file .*default_config.yaml"):
        resolve_launcher_settings({"mixed_precision": "bf16"}, env, _command([], env), "cfg.json")


def test_environment_variable_counts_without_a_launcher():
    out = resolve_launcher_settings({}, {"ACCELERATE_MIXED_PRECISION": "bf16"}, None, "cfg.json")
    assert out.settings["mixed_precision"].source.startswith("from the environment variable ACCELERATE_MIXED_PRECISION")
    with pytest.raises(ConfigError, match="cfg.json says 'no'"):
        resolve_launcher_settings({"mixed_precision": "no"}, {"ACCELERATE_MIXED_PRECISION": "bf16"}, None, "cfg.json")


def test_unsupported_launcher_values_stop():
    with pytest.raises(ConfigError) as err:
        resolve_launcher_settings(
            {}, {"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_DYNAMO_BACKEND": "aot_eager"}, None, "cfg.json"
        )
    text = str(err.value)
    assert "'fp8', which this trainer does not support" in text
    assert "'aot_eager' backend" in text and "enable_compile" in text


def test_accumulation_from_the_launcher_and_its_conflicts():
    env = {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}
    assert resolve_launcher_settings({}, env, None).overrides == ["gradient_accumulation_steps=4"]
    assert resolve_launcher_settings({"gradient_accumulation_steps": 4}, env, None).overrides == []
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: the config says 2"):
        resolve_launcher_settings({"gradient_accumulation_steps": 2}, env, None)
    ramp = {"gh200_optimizations": {"enable_batch_size_rampup": True}}
    with pytest.raises(ConfigError, match="enable_batch_size_rampup decides"):
        resolve_launcher_settings(ramp, env, None)


def test_find_launch_command_walks_up_to_the_launcher():
    table = {
        30: ["/venv/bin/python", "-c", "from multiprocessing.spawn import spawn_main"],
        20: ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--mixed_precision", "bf16", "train.py"],
    }
    parents = {30: 20, 20: 1}
    assert find_launch_command(30, table.get, parents.get) == ["--mixed_precision", "bf16", "train.py"]
    assert find_launch_command(30, {30: ["bash"]}.get, {30: 1}.get) is None
    module = {5: ["python", "-m", "accelerate.commands.launch", "--num_processes", "2", "x.py"]}
    assert find_launch_command(5, module.get, {}.get) == ["--num_processes", "2", "x.py"]


def test_prepare_config_injects_and_reports_in_one_pass(make_config, tmp_path, no_default_accelerate_config):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(make_config()))
    env = {
        **no_default_accelerate_config,
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
    }
    loaded, sources, _ = prepare_config(str(path), environ=env, launch_command=None)
    assert loaded.config.mixed_precision == "bf16" and loaded.config.gradient_accumulation_steps == 2
    assert loaded.raw["mixed_precision"] == "bf16"  # written to output_dir/config.json as in force
    assert "ACCELERATE_MIXED_PRECISION" in sources["mixed_precision"]

    path.write_text(json.dumps(make_config(mixed_precision="no", learning_rate=-1)))
    env["PYTORCH_CUDA_ALLOC_CONF"] = "use_uvm:True,expandable_segments:True"
    with pytest.raises(ConfigError) as err:
        prepare_config(str(path), environ=env, launch_command=None)
    text = str(err.value)
    assert "mixed_precision:" in text and "use_uvm" in text and "learning_rate" in text
    assert 'export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"' in text


def test_accelerate_accumulation_never_divides_the_loss(make_config, tmp_path, monkeypatch):
    """A launcher's accumulation count reaches the config, not Accelerate (whose backward would divide by it)."""
    from simpletuner.state import StateTracker
    from simpletuner.training.trainer import Trainer

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")  # unset in the JSON: asks for enable_compile
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(make_config(max_train_steps=1, enable_compile=False)))
    with pytest.raises(ConfigError, match="enable_compile: .* says False but the environment variable"):
        prepare_config(str(path), launch_command=None)
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND")
    loaded, sources, _ = prepare_config(str(path), launch_command=None)
    state = StateTracker(loaded.config, loaded.raw)
    state.setting_sources = sources
    trainer = Trainer(state)
    trainer.setup()
    assert trainer.config.gradient_accumulation_steps == 3
    assert trainer.accelerator.gradient_accumulation_steps == 1
    assert trainer.accumulation.window_for(0) == 3


def _launch(tmp_path, cfg: dict, *launch_args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launch_args,
        str(REPO / "simpletuner" / "train.py"),
        "--config",
        str(path),
    ]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_seed_launch_line_trains_in_bf16_and_says_so(make_config, tmp_path):
    """The seed's GH200 launch line with a JSON that leaves precision to it: bf16, logged with its source."""
    cfg = make_config(max_train_steps=1)
    cfg.pop("mixed_precision", None)
    proc = _launch(tmp_path, cfg, "--config_file", str(GH200_YAML))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"mixed precision bf16 in force, from the Accelerate config file {GH200_YAML} (mixed_precision: bf16)"
        in proc.stderr
    )
    written = json.loads((Path(cfg["output_dir"]) / "config.json").read_text())
    assert written["mixed_precision"] == "bf16"


def test_seed_launch_line_with_a_conflicting_json_stops_before_loading(make_config, tmp_path):
    proc = _launch(tmp_path, make_config(mixed_precision="no"), "--config_file", str(GH200_YAML))
    assert proc.returncode != 0
    assert "mixed_precision: " in proc.stderr and "says 'no'" in proc.stderr and "says 'bf16'" in proc.stderr
    assert "vae cache" not in proc.stderr  # nothing was encoded or loaded


def test_unknown_allocator_keys_are_warned_in_the_run_log(make_config, tmp_path, monkeypatch):
    """A key stock PyTorch may not know is a warning (not an error), and it reaches training.log."""
    from simpletuner.cli.train import main as train_main

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,made_up_key:3")
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(make_config(max_train_steps=1)))
    assert train_main(["--config", str(path)]) == 0
    log = (tmp_path / "output" / "training.log").read_text()
    assert "WARNING" in log and "`made_up_key`" in log
