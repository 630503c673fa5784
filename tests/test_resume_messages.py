"""A refused resume says what to do, and a launch prints it once (rank 0), with exit code 2."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from simpletuner.cli.train import main
from simpletuner.training.checkpoint import check_compatible

IDENTITY = {"model_family": "sd", "training_type": "lora", "lora_type": "standard", "lora_rank": 4}


def test_identity_mismatch_ends_with_the_fix():
    state = {"identity": IDENTITY, "world_size": 1}
    with pytest.raises(ValueError) as info:
        check_compatible(state, dict(IDENTITY, lora_rank=8), 1, Path("out/checkpoint-2"))
    text = str(info.value)
    assert "lora_rank: checkpoint has 4, config has 8" in text
    assert (
        "put the settings above back" in text and "new `output_dir`" in text and "resume_from_checkpoint: null" in text
    )
    assert "--num_processes" not in text  # the world size is fine: no launch advice


def test_world_size_mismatch_names_the_launch_that_continues_it():
    with pytest.raises(ValueError) as info:
        check_compatible({"identity": IDENTITY, "world_size": 1}, IDENTITY, 2, Path("out/checkpoint-2"))
    text = str(info.value)
    assert "written by 1 process(es), this run has 2" in text
    assert "accelerate launch --num_processes 1" in text and "resume_from_checkpoint: null" in text
    assert "settings above" not in text


def test_config_errors_print_on_rank_zero_only(make_config, tmp_path, monkeypatch, capsys):
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(make_config(train_batch_size="four")))
    monkeypatch.setenv("RANK", "1")
    assert main(["--config", str(path)]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["--config", str(path)]) == 2
    assert "train_batch_size" in capsys.readouterr().err


@pytest.mark.slow
def test_two_process_resume_of_a_one_process_checkpoint_is_refused_once(make_config, tmp_path):
    from test_distributed import _launch

    raw = make_config(max_train_steps=1, checkpointing_steps=1, train_batch_size=1)
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    assert main(["--config", str(path)]) == 0
    path.write_bytes(orjson.dumps(dict(raw, max_train_steps=2, resume_from_checkpoint="latest")))
    proc = _launch(path, timeout=240)
    assert proc.returncode != 0
    err = proc.stderr
    assert err.count("error: cannot resume from") == 1, err[-4000:]
    assert "accelerate launch --num_processes 1" in err and "resume_from_checkpoint: null" in err
    # the training processes exit 2 with the message, not with a Python traceback of theirs
    assert "exitcode  : 2" in err or "exit status 2" in err, err[-4000:]
    assert "ResumeRefused" not in err and "check_compatible" not in err
