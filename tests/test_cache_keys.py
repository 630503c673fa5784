"""Training and ``simpletuner cache`` agree on cache keys: a tiny run records every key it reads, then
``cache verify`` and ``cache clear --stale-only --dry-run`` (through the ``simpletuner`` entry point)
find exactly those keys needed, nothing stale and nothing missing; after a change of resolution the
dry run lists exactly the old latents as stale. Both sides build keys with ``caching.keys.cache_keys``."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from training_helpers import train

from simpletuner.caching import ShardedTensorStore, TensorCache
from simpletuner.cli import main as simpletuner


@pytest.fixture
def reads(monkeypatch) -> dict[str, set[str]]:
    """Every key read from a cache while training, by cache name ("vae", "text")."""
    read: dict[str, set[str]] = {"vae": set(), "text": set()}
    get_batch = TensorCache.get_batch

    def recording(self, keys):
        read.setdefault(self.name, set()).update(keys)
        return get_batch(self, keys)

    monkeypatch.setattr(TensorCache, "get_batch", recording)
    return read


def _verify(cfg: Path, capsys) -> dict[str, dict]:
    capsys.readouterr()
    assert simpletuner(["cache", "verify", "--config", str(cfg), "--json"]) == 0
    return {cache["name"]: cache for cache in json.loads(capsys.readouterr().out)["caches"]}


def _dry_run(cfg: Path, capsys) -> tuple[str, dict[str, set[str]]]:
    """``clear --stale-only --dry-run``: its output, and the stale keys it lists by cache."""
    capsys.readouterr()
    assert simpletuner(["cache", "clear", "--config", str(cfg), "--stale-only", "--dry-run"]) == 0
    out = capsys.readouterr().out
    stale: dict[str, set[str]] = {"vae": set(), "text": set()}
    cache = None
    for line in out.splitlines():
        if line.startswith("  ") and " cache " in line and not line.startswith("    "):
            cache = line.split()[0]
        elif line.startswith("    stale "):
            stale[cache].add(line.split()[1])
    return out, stale


def test_cache_commands_find_exactly_the_keys_training_read(make_config, reads, tmp_path, capsys):
    # One epoch at batch size 1 reads every sample's latent and caption.
    raw = make_config(max_train_steps=None, num_train_epochs=1, train_batch_size=1)
    trainer, _ = train(raw)
    cache_dir = Path(raw["cache_config"]["cache_dir"]) / "sd"
    stored = {name: set(ShardedTensorStore(cache_dir / name).keys()) for name in ("vae", "text")}
    assert len(reads["vae"]) == 12 and reads["text"]
    assert reads == stored  # training read every entry it stored, and nothing else
    assert set(trainer.data.latent_keys.values()) == reads["vae"]  # what cache_keys gave the trainer
    assert set(trainer.data.text_keys.values()) == reads["text"]

    cfg = tmp_path / "cfg.json"
    cfg.write_bytes(orjson.dumps(raw))
    for name, cache in _verify(cfg, capsys).items():
        assert cache["num_needed"] == cache["num_present"] == len(reads[name]), name
        assert cache["num_missing"] == cache["num_stale"] == 0, name
    out, stale = _dry_run(cfg, capsys)
    assert "nothing to remove" in out and stale == {"vae": set(), "text": set()}

    # Another resolution needs other latents: exactly the ones training read are stale, no caption changed.
    cfg.write_bytes(orjson.dumps(dict(raw, resolution=48)))
    caches = _verify(cfg, capsys)
    assert caches["vae"]["num_stale"] == 12 and caches["vae"]["num_missing"] == 12
    assert caches["text"]["num_stale"] == caches["text"]["num_missing"] == 0
    out, stale = _dry_run(cfg, capsys)
    assert stale == {"vae": reads["vae"], "text": set()}
    assert "would remove:" in out and "dry run: nothing removed" in out
    assert {name: set(ShardedTensorStore(cache_dir / name).keys()) for name in ("vae", "text")} == stored
