"""`simpletuner cache verify|clear` end to end: real tiny training fills the caches, then we damage them."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import orjson
import pytest
from test_caching_integrity import flip_byte, truncate

from simpletuner.caching import ShardedTensorStore
from simpletuner.cli.cache import main
from simpletuner.configuration import validate_config
from simpletuner.state import StateTracker
from simpletuner.training.trainer import Trainer


def _write(raw: dict, path: Path) -> str:
    path.write_bytes(orjson.dumps(raw))
    return str(path)


def _train(raw: dict) -> Trainer:
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    trainer.train()
    return trainer


def _verify_json(cfg: str, capsys) -> tuple[int, dict[str, dict]]:
    capsys.readouterr()
    code = main(["verify", "--config", cfg, "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert payload["is_clean"] is (code == 0)
    return code, {cache["name"]: cache for cache in payload["caches"]}


def _verify_text(cfg: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["verify", "--config", cfg])
    return code, capsys.readouterr().out


@pytest.fixture
def trained(make_config, tmp_path):
    """A config file whose caches one training step has filled: (config path, raw config)."""
    raw = make_config(max_train_steps=1)
    _train(raw)
    return _write(raw, tmp_path / "cfg.json"), raw


def _store(raw: dict, name: str) -> ShardedTensorStore:
    return ShardedTensorStore(Path(raw["cache_config"]["cache_dir"]) / "sd" / name)


def test_verify_after_training_lists_sound_caches_with_counts(trained, capsys):
    cfg, raw = trained
    code, caches = _verify_json(cfg, capsys)
    assert code == 0
    vae, text = caches["vae"], caches["text"]
    assert vae["num_needed"] == vae["num_present"] == vae["num_entries"] == vae["num_ok"] == 12
    assert vae["num_missing"] == 0 and vae["num_stale"] == 0 and vae["corrupt"] == {}
    assert text["num_entries"] >= 1 and text["num_needed"] == text["num_present"] == text["num_entries"]
    assert vae["num_shards"] >= 1 and vae["num_bytes"] > 0 and vae["folder"].endswith("sd/vae")

    code, out = _verify_text(cfg, capsys)
    assert code == 0
    assert "needed by this config: 12, present: 12" in out and "checksums: 12 ok, 0 corrupt" in out
    assert "all entries are sound" in out


def test_flipped_byte_fails_verify_then_training_re_encodes_it(trained, make_config, capsys):
    cfg, raw = trained
    store = _store(raw, "vae")
    shard, keys = next(iter(store.shard_entries().items()))
    flip_byte(shard, keys[0])

    code, out = _verify_text(cfg, capsys)
    assert code == 1
    assert f"corrupt {keys[0]}: checksum mismatch in tensor 'latents'" in out
    assert "re-encoded on the next training run" in out and "simpletuner cache clear" in out

    trainer = _train(dict(raw, output_dir=raw["output_dir"] + "_again"))  # the first run's folder holds a finished run
    assert trainer.data.fill_reports["latents"].corrupt == (keys[0],)
    assert trainer.data.fill_reports["latents"].num_computed == 1
    code, caches = _verify_json(cfg, capsys)
    assert code == 0 and caches["vae"]["num_ok"] == 12 and caches["vae"]["num_superseded"] == 1


def test_truncated_text_shard_fails_verify_then_is_re_encoded_and_moved_aside(trained, capsys):
    cfg, raw = trained
    [shard] = _store(raw, "text").shard_entries()
    truncate(shard)
    code, caches = _verify_json(cfg, capsys)
    assert code == 1
    text = caches["text"]
    assert list(text["unreadable_shards"]) == [str(shard)] and "truncated" in text["unreadable_shards"][str(shard)]
    assert text["num_missing"] == text["num_needed"] and len(text["corrupt"]) == text["num_needed"]

    trainer = _train(dict(raw, output_dir=raw["output_dir"] + "_again"))  # the first run's folder holds a finished run
    assert len(trainer.data.fill_reports["text"].corrupt) == text["num_needed"]
    code, caches = _verify_json(cfg, capsys)
    assert code == 0 and caches["text"]["quarantined_files"] == [str(shard) + ".corrupt"]


def test_changed_vae_makes_old_latents_stale_and_training_re_encodes(make_config, tiny_sd, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_sd, model)  # the session's tiny model is shared: change a copy
    raw = make_config(max_train_steps=1, pretrained_model_name_or_path=str(model))
    cfg = _write(raw, tmp_path / "cfg.json")
    _train(raw)

    vae_config = model / "vae" / "config.json"
    settings = json.loads(vae_config.read_text())
    settings["scaling_factor"] = settings["scaling_factor"] * 2
    vae_config.write_text(json.dumps(settings))

    code, caches = _verify_json(cfg, capsys)
    assert code == 0  # stale is not corrupt
    assert caches["vae"]["num_present"] == 0 and caches["vae"]["num_missing"] == 12
    assert caches["vae"]["num_stale"] == 12
    assert caches["text"]["num_stale"] == 0  # the text encoder did not change
    code, out = _verify_text(cfg, capsys)
    assert "stale: 12 entries not needed by this config" in out and "--stale-only" in out

    trainer = _train(dict(raw, output_dir=str(tmp_path / "after_vae_change")))  # another model: another run's folder
    latents = trainer.data.fill_reports["latents"]
    assert (latents.num_hits, latents.num_computed) == (0, 12)
    assert trainer.data.fill_reports["text"].num_computed == 0

    code, caches = _verify_json(cfg, capsys)
    assert code == 0 and caches["vae"]["num_entries"] == 24 and caches["vae"]["num_stale"] == 12
    assert main(["clear", "--config", cfg, "--stale-only", "--yes"]) == 0
    assert "12 stale" in capsys.readouterr().out
    code, caches = _verify_json(cfg, capsys)
    assert code == 0 and caches["vae"]["num_entries"] == 12 and caches["vae"]["num_stale"] == 0
    assert caches["vae"]["num_present"] == 12 and caches["text"]["num_present"] == caches["text"]["num_needed"]
    # Nothing left to remove.
    assert main(["clear", "--config", cfg, "--stale-only", "--yes"]) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_clear_asks_refuses_off_a_terminal_and_removes_with_yes(trained, monkeypatch, capsys):
    cfg, raw = trained
    base = Path(raw["cache_config"]["cache_dir"]) / "sd"
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal
    assert main(["clear", "--config", cfg]) == 2
    assert "--yes" in capsys.readouterr().err and (base / "vae").is_dir()

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    assert main(["clear", "--config", cfg]) == 1
    assert "nothing removed" in capsys.readouterr().out and (base / "text").is_dir()

    monkeypatch.setattr("sys.stdin", Terminal("y\n"))
    assert main(["clear", "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert str(base / "vae") in out and str(base / "text") in out and "removed 2 cache folder(s)" in out
    assert not base.exists()

    assert main(["clear", "--config", cfg, "--yes"]) == 0
    assert "nothing to remove" in capsys.readouterr().out
    code, caches = _verify_json(cfg, capsys)
    assert code == 0 and caches["vae"]["exists"] is False and caches["vae"]["num_missing"] == 12
    assert not base.exists()  # verify creates nothing


def test_clear_yes_removes_both_caches(trained, capsys):
    cfg, raw = trained
    assert main(["clear", "--config", cfg, "--yes"]) == 0
    assert not (Path(raw["cache_config"]["cache_dir"]) / "sd").exists()


def test_verify_still_checks_checksums_when_the_dataset_is_gone(trained, tmp_path, capsys):
    cfg, raw = trained
    moved = dict(raw, datasets=[dict(raw["datasets"][0], instance_data_dir=str(tmp_path / "gone"))])
    cfg = _write(moved, tmp_path / "moved.json")
    code, out = _verify_text(cfg, capsys)
    assert code == 0 and "cannot tell which entries this config needs" in out and "12 ok" in out
    assert main(["clear", "--config", cfg, "--stale-only", "--yes"]) == 2


def test_bad_config_is_a_usage_error(tmp_path, capsys):
    assert main(["verify", "--config", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
