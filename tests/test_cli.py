"""The `simpletuner` command: train errors, zoo, and the demo through the real train path."""

from __future__ import annotations

import orjson

from simpletuner.cli import main


def test_train_with_bad_config_exits_2_and_lists_problems(tmp_path, capsys, make_config):
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(make_config(lerning_rate=1, train_batch_size=0)))
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "2 problem(s)" in err and "did you mean 'learning_rate'" in err and "train_batch_size" in err
    assert not (tmp_path / "output").exists(), "a bad config must not create anything"


def test_zoo_writes_a_loadable_pipeline(tmp_path):
    from diffusers import StableDiffusionPipeline

    assert main(["zoo", "--family", "sd", "--out", str(tmp_path / "m")]) == 0
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "m", safety_checker=None)
    assert pipe.tokenizer.model_max_length == 77


def test_demo_trains_and_writes_before_and_after_samples(tmp_path, capsys):
    assert main(["demo", "--dir", str(tmp_path / "demo"), "--steps", "4"]) == 0
    out = tmp_path / "demo" / "output"
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    names = sorted(p.name for p in (out / "validation").glob("*.png"))
    assert names == ["step_000000_0.png", "step_000000_1.png", "step_000004_0.png", "step_000004_1.png"]
    config = orjson.loads((tmp_path / "demo" / "config.json").read_bytes())
    assert config["max_train_steps"] == 4
    assert "LoRA at" in capsys.readouterr().out


def test_cache_verify_and_clear_through_the_cli(tmp_path, capsys, make_config):
    raw = make_config(max_train_steps=1)
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    assert main(["train", "--config", str(path)]) == 0
    capsys.readouterr()
    assert main(["cache", "verify", "--config", str(path), "--json"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert report  # one report per cache, with entries present
    assert main(["cache", "clear", "--config", str(path), "--yes"]) == 0
    assert not any((tmp_path / "cache").rglob("*.safetensors"))
