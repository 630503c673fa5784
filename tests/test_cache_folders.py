"""Per-dataset latent folders (``datasets[].cache_dir_vae``) and the text folder (``cache_config.text_cache_dir``):
a tiny run stores each dataset's latents in its own folder and the embeddings in the text folder,
``simpletuner cache verify`` finds every key training read there, a second run encodes nothing, each
folder carries its own cache locks, and ``cache clear`` empties them all."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import orjson
import pytest
from training_helpers import train

from simpletuner.caching import ShardedTensorStore, TensorCache
from simpletuner.caching.routing import CacheFolders
from simpletuner.cli import main as simpletuner
from simpletuner.configuration import validate_config
from simpletuner.data_backend import BucketSampler
from simpletuner.locks import CACHE_USERS_LOCK_NAME


@pytest.fixture
def reads(monkeypatch) -> dict[str, set[str]]:
    """Every key read from a cache while training, by the folder of the cache."""
    read: dict[str, set[str]] = {}
    get_batch = TensorCache.get_batch

    def recording(self, keys):
        read.setdefault(str(self.store.root), set()).update(keys)
        return get_batch(self, keys)

    monkeypatch.setattr(TensorCache, "get_batch", recording)
    return read


def _two_datasets(make_config, shapes_dir: Path, tmp_path: Path, **overrides) -> dict:
    """Dataset "one" (its latents in its own folder, named with place-holders) and "two" (the default
    folder): the same images under another id, so each has its own keys."""
    copy = tmp_path / "shapes-two"
    if not copy.exists():
        shutil.copytree(shapes_dir, copy)
    raw = make_config(
        **{"max_train_steps": None, "num_train_epochs": 1, "train_batch_size": 2, **overrides},
        datasets=[
            {
                "id": "one",
                "type": "local",
                "instance_data_dir": str(shapes_dir),
                "cache_dir_vae": str(tmp_path / "lat" / "{model_family}-{id}"),
            },
            {"id": "two", "type": "local", "instance_data_dir": str(copy)},
        ],
    )
    raw["cache_config"] = {**raw["cache_config"], "text_cache_dir": str(tmp_path / "emb-{model_family}")}
    return raw


def _verify(cfg: Path, capsys) -> list[dict]:
    capsys.readouterr()
    assert simpletuner(["cache", "verify", "--config", str(cfg), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["caches"]


def test_latents_and_embeddings_go_to_their_folders(make_config, shapes_dir, tmp_path, reads, capsys):
    raw = _two_datasets(make_config, shapes_dir, tmp_path)
    trainer, _ = train(raw)
    own, default = tmp_path / "lat" / "sd-one", tmp_path / "cache" / "sd" / "vae"
    text = tmp_path / "emb-sd"
    data = trainer.data

    by_dataset = {ds.id: {data.latent_keys[s.key] for s in ds.samples} for ds in trainer.state.datasets}
    assert len(by_dataset["one"]) == len(by_dataset["two"]) == 12
    assert not by_dataset["one"] & by_dataset["two"]
    assert set(ShardedTensorStore(own).keys()) == by_dataset["one"] == reads[str(own)]
    assert set(ShardedTensorStore(default).keys()) == by_dataset["two"] == reads[str(default)]
    assert set(ShardedTensorStore(text).keys()) == set(data.text_keys.values()) == reads[str(text)]
    assert not (tmp_path / "cache" / "sd" / "text").exists()  # the default text folder is not made
    for base in (own, text, tmp_path / "cache" / "sd"):  # each folder carries its own locks
        assert (base / CACHE_USERS_LOCK_NAME).exists(), base

    cfg = tmp_path / "cfg.json"
    cfg.write_bytes(orjson.dumps(raw))
    caches = {Path(c["folder"]): c for c in _verify(cfg, capsys)}
    assert set(caches) == {default, own, text}
    for folder, cache in caches.items():
        assert cache["num_needed"] == cache["num_present"] == len(reads[str(folder)]), folder
        assert cache["num_missing"] == cache["num_stale"] == 0 and not cache["has_corruption"], folder

    # A second run finds every latent and embedding where the first put them.
    again, _ = train(dict(raw, output_dir=str(tmp_path / "second"), max_train_steps=1, num_train_epochs=None))
    assert again.data.fill_reports["latents"].num_computed == 0
    assert again.data.fill_reports["latents"].num_hits == 24
    assert again.data.fill_reports["text"].num_computed == 0

    # Without cache_dir_vae dataset one's latents are missing from the default folder, and the
    # ones in its own folder are no longer this config's (verify lists that folder no more).
    plain = dict(raw, datasets=[{k: v for k, v in d.items() if k != "cache_dir_vae"} for d in raw["datasets"]])
    cfg.write_bytes(orjson.dumps(plain))
    caches = {Path(c["folder"]): c for c in _verify(cfg, capsys)}
    assert set(caches) == {default, text}
    assert caches[default]["num_missing"] == 12 and caches[default]["num_stale"] == 0

    # `cache clear` empties every folder of the config, its own folders included.
    cfg.write_bytes(orjson.dumps(raw))
    capsys.readouterr()
    assert simpletuner(["cache", "clear", "--config", str(cfg), "--yes"]) == 0
    assert not list(own.glob("shard-*")) and not list(text.glob("shard-*"))
    assert not (tmp_path / "cache" / "sd" / "vae").exists()


def test_two_datasets_naming_one_folder_share_it(make_config, shapes_dir, tmp_path):
    raw = _two_datasets(make_config, shapes_dir, tmp_path, max_train_steps=1, num_train_epochs=None)
    shared = str(tmp_path / "lat" / "shared")
    for dataset in raw["datasets"]:
        dataset["cache_dir_vae"] = shared
    raw["datasets"][0]["probability"] = 3.0
    trainer, _ = train(raw)
    assert len(ShardedTensorStore(Path(shared)).keys()) == 24
    assert not (tmp_path / "cache" / "sd" / "vae").exists()
    assert trainer.data.dataset_vae_caches["one"] is trainer.data.dataset_vae_caches["two"]
    # The trainer's sampler draws with the datasets' probabilities.
    samples = [s for ds in trainer.state.datasets for s in ds.samples]
    expected = BucketSampler(samples, 2, seed=raw["seed"], weights={"one": 3.0, "two": 1.0})
    trainer.sampler.set_epoch(0)
    assert [[s.key for s in b] for b in trainer.sampler] == [[s.key for s in b] for b in expected]


def test_cache_folders_fill_their_place_holders(tmp_path):
    raw = {
        "pretrained_model_name_or_path": "unused",
        "model_family": "flux",
        "max_train_steps": 1,
        "output_dir": str(tmp_path / "out"),
        "cache_config": {"cache_dir": str(tmp_path / "c"), "text_cache_dir": "{output_dir}/emb-{model_family}"},
        "datasets": [
            {
                "id": "x",
                "type": "local",
                "instance_data_dir": str(tmp_path / "d"),
                "cache_dir_vae": str(tmp_path / "{id}"),
            },
            {
                "id": "y",
                "type": "local",
                "instance_data_dir": str(tmp_path / "d"),
                "disabled": True,
                "cache_dir_vae": "z",
            },
            {"id": "w", "type": "local", "instance_data_dir": str(tmp_path / "d")},
        ],
    }
    folders = CacheFolders.of(validate_config(raw, check_files=False), "flux")
    assert folders.text == tmp_path / "out" / "emb-flux"
    assert folders.vae_folder("x") == tmp_path / "x"
    assert folders.vae_folder("w") == folders.default_vae == tmp_path / "c" / "flux" / "vae"
    assert "y" not in folders.dataset_vae  # a left-out dataset has no folder
    assert folders.lock_base(folders.default_vae) == tmp_path / "c" / "flux"
    assert folders.lock_base(tmp_path / "x") == tmp_path / "x"
