"""A run's end and its output folder: the last step is a checkpoint, a finished run is not re-saved,
every checkpoint carries a loadable adapter, and an output_dir holds one run."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest
from training_helpers import train

from simpletuner.training import checkpoint as ckpt


def _snapshot(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its modification time (ns)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_the_last_step_is_a_checkpoint_and_a_finished_run_is_not_resaved(make_config, tmp_path, caplog):
    out = tmp_path / "run"
    _, first = train(make_config(max_train_steps=3, output_dir=str(out)))  # no checkpointing_steps
    assert first.global_step == 3
    assert ckpt.find_latest(out).name == "checkpoint-3"
    assert ckpt.read_trainer_state(out / "checkpoint-3")["global_step"] == 3

    # Extending it trains only the new steps, from the end.
    trainer, longer = train(make_config(max_train_steps=5, output_dir=str(out), resume_from_checkpoint="latest"))
    assert longer.global_step == 5 and len(longer.losses) == 2
    assert ckpt.find_latest(out).name == "checkpoint-5"

    # Resuming a finished run says so, trains nothing and writes nothing.
    before = _snapshot(out)
    path = tmp_path / "again.json"
    path.write_bytes(orjson.dumps(make_config(max_train_steps=4, output_dir=str(out), resume_from_checkpoint="latest")))
    from simpletuner.cli.train import main

    with caplog.at_level(logging.WARNING, logger="simpletuner"):
        assert main(["--config", str(path)]) == 0
    assert "already finished" in caplog.text and "step 5" in caplog.text and "max_train_steps" in caplog.text
    assert _snapshot(out) == before


def test_checkpoint_at_end_can_be_turned_off(make_config, tmp_path):
    out = tmp_path / "run"
    train(make_config(max_train_steps=2, output_dir=str(out), checkpoint_at_end=False))
    assert ckpt.list_checkpoints(out) == []
    assert (out / "pytorch_lora_weights.safetensors").is_file()


def test_every_checkpoint_carries_an_adapter_diffusers_loads(make_config, tmp_path):
    import torch
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    out = tmp_path / "run"
    raw = make_config(
        max_train_steps=4, checkpointing_steps=2, learning_rate=1e-2, lora_rank=8, lora_alpha=4, output_dir=str(out)
    )
    _, result = train(raw)
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    # The last checkpoint's adapter is the final adapter, file for file.
    final = load_file(result.output_path)
    at_end = load_file(out / "checkpoint-4" / "pytorch_lora_weights.safetensors")
    assert final.keys() == at_end.keys() and all(torch.equal(final[k], at_end[k]) for k in final)

    # An intermediate checkpoint's adapter loads through diffusers and changes the output,
    # differently from the final one.
    model = raw["pretrained_model_name_or_path"]
    gen = torch.Generator().manual_seed(1)
    x, t, ctx = torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 500]), torch.randn(2, 77, 32, generator=gen)

    def unet_output(adapter_folder: Path | None) -> torch.Tensor:
        pipe = StableDiffusionPipeline.from_pretrained(model, safety_checker=None)
        if adapter_folder is not None:
            pipe.load_lora_weights(str(adapter_folder))
        with torch.no_grad():
            return pipe.unet(x, t, ctx).sample

    base, step2, step4 = unet_output(None), unet_output(out / "checkpoint-2"), unet_output(out)
    assert not torch.allclose(step2, base, atol=1e-4), "the step-2 adapter must change the output"
    assert not torch.allclose(step2, step4, atol=1e-4), "step 2 and step 4 are different adapters"


def test_lycoris_checkpoints_carry_the_lycoris_file(make_config, tmp_path):
    pytest.importorskip("lycoris", reason="the lycoris extra is not installed")
    from safetensors.torch import load_file

    out = tmp_path / "run"
    _, result = train(
        make_config(lora_type="lycoris", lycoris={"algo": "lokr"}, lora_rank=4, max_train_steps=1, output_dir=str(out))
    )
    saved = load_file(out / "checkpoint-1" / "pytorch_lora_weights.safetensors")
    final = load_file(result.output_path)
    assert saved.keys() == final.keys() and all(k.startswith("lycoris_") for k in saved)


def _write(tmp_path: Path, raw: dict, name: str = "cfg.json") -> str:
    path = tmp_path / name
    path.write_bytes(orjson.dumps(raw))
    return str(path)


def test_an_output_dir_holding_a_finished_run_is_refused_until_resume_or_overwrite(make_config, tmp_path, capsys):
    from simpletuner.cli.train import main

    out = tmp_path / "run"
    train(make_config(max_train_steps=3, output_dir=str(out)))
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)

    # Same config, no resume_from_checkpoint: refused before anything loads or is written.
    assert main(["--config", _write(tmp_path, make_config(max_train_steps=3, output_dir=str(out)))]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "checkpoint-3" in err and "pytorch_lora_weights.safetensors" in err
    assert 'resume_from_checkpoint "latest"' in err and "another output_dir" in err and "--overwrite" in err
    assert _snapshot(out) == before

    # Another config: it cannot be resumed, so that is not offered; the difference is named.
    assert main(["--config", _write(tmp_path, make_config(max_train_steps=3, output_dir=str(out), lora_rank=8))]) == 2
    err = capsys.readouterr().err
    assert "lora_rank: checkpoint has 16, config has 8" in err and 'resume_from_checkpoint "latest" (' not in err
    assert _snapshot(out) == before

    # --overwrite replaces the run's files (not the user's) and trains afresh.
    assert main(["--config", _write(tmp_path, make_config(max_train_steps=2, output_dir=str(out))), "--overwrite"]) == 0
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-2"]
    assert (out / "notes.txt").read_text() == "mine" and (out / "pytorch_lora_weights.safetensors").is_file()
    assert "step 3" not in (out / "training.log").read_text()


def test_resume_latest_over_weights_without_a_checkpoint_is_refused(make_config, tmp_path):
    out = tmp_path / "run"
    train(make_config(max_train_steps=1, output_dir=str(out), checkpoint_at_end=False))
    with pytest.raises(
        ValueError, match='no checkpoint, so resume_from_checkpoint "latest" has nothing to continue from'
    ):
        train(make_config(max_train_steps=2, output_dir=str(out), resume_from_checkpoint="latest"))
    assert ckpt.list_checkpoints(out) == []


def test_the_readme_demo_commands_train_longer_and_rerun(tmp_path):
    from simpletuner.cli import main

    demo = tmp_path / "demo_run"
    assert main(["demo", "--dir", str(demo), "--steps", "2"]) == 0
    config = str(demo / "config.json")
    # README: `simpletuner train --config demo_run/config.json --set max_train_steps=...` trains longer.
    assert main(["train", "--config", config, "--set", "max_train_steps=3"]) == 0
    log = (demo / "output" / "training.log").read_text()
    assert "resumed from" in log and "checkpoint-2" in log
    assert ckpt.find_latest(demo / "output").name == "checkpoint-3"
    # Re-running the demo starts it afresh (it passes --overwrite) instead of being refused.
    assert main(["demo", "--dir", str(demo), "--steps", "2"]) == 0
    assert ckpt.find_latest(demo / "output").name == "checkpoint-2"
    assert not (demo / "output" / "checkpoint-3").exists()
    # `simpletuner train --overwrite` reaches the trainer too.
    assert (
        main(
            [
                "train",
                "--config",
                config,
                "--overwrite",
                "--set",
                "max_train_steps=1",
                "--set",
                "validation_prompt=null",
            ]
        )
        == 0
    )
    assert [p.name for p in ckpt.list_checkpoints(demo / "output")] == ["checkpoint-1"]
