"""Content, not just identity: an image edited in place with its size and mtime kept.

A latent's cache key names its image by identity (size + mtime), so such an edit is a hit on
the old latent: the documented blind spot of the default. Each latent also records a hash of
the image's bytes; ``cache_config.verify_content`` re-hashes the sources of the latents a run
reuses and re-encodes the changed ones, and ``simpletuner cache verify --content [--fix]``
finds (and removes) them without training. Real tiny runs fill the cache; the edit is a real
one (an uncompressed PNG keeps its length whatever its pixels).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from pathlib import Path

import orjson
import pytest
import torch
from PIL import Image

from simpletuner.caching import ShardedTensorStore
from simpletuner.caching.fingerprint import source_hash
from simpletuner.caching.memory_store import MemoryTensorStore
from simpletuner.caching.tensor_cache import SourceCheck, TensorCache
from simpletuner.cli.cache import main
from simpletuner.configuration import validate_config
from simpletuner.state import StateTracker
from simpletuner.training.trainer import Trainer

EDITED = "000.png"
SAMPLE_KEY = f"shapes/{EDITED}"


def _png(image: Image.Image) -> bytes:
    """Stored (level-0) deflate: the file's length depends on the pixel count, not the pixels."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=0)
    return buffer.getvalue()


def _edit_in_place(path: Path) -> None:
    """New pixels, same byte count, same mtime: what a sync tool or `touch -r` can leave behind."""
    before = path.stat()
    image = Image.open(path).convert("RGB")
    edited = _png(Image.eval(image, lambda value: 255 - value))
    assert len(edited) == before.st_size and edited != path.read_bytes()
    with open(path, "r+b") as handle:  # rewrite in place: same inode, same length
        handle.write(edited)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.fixture
def dataset(shapes_dir, tmp_path) -> Path:
    """A copy of the shapes dataset whose edited image is an uncompressed PNG."""
    data = tmp_path / "data"
    shutil.copytree(shapes_dir, data)
    image = data / EDITED
    image.write_bytes(_png(Image.open(image).convert("RGB")))
    return data


def _train(raw: dict, output: str) -> Trainer:
    raw = dict(raw, output_dir=output)  # each run its own folder: a finished run's folder is not extended
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    trainer.train()
    return trainer


def _verify(cfg: str, capsys, *flags: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["verify", "--config", cfg, *flags])
    return code, capsys.readouterr().out


def _verify_json(cfg: str, capsys, *flags: str) -> tuple[int, dict, dict[str, dict]]:
    code, out = _verify(cfg, capsys, "--json", *flags)
    payload = json.loads(out)
    assert payload["is_clean"] is (code == 0)
    return code, payload, {cache["name"]: cache for cache in payload["caches"]}


def test_in_place_edit_is_reused_by_default_and_re_encoded_under_verify_content(
    make_config, dataset, tmp_path, capsys, caplog
):
    raw = make_config(
        max_train_steps=1, datasets=[{"id": "shapes", "type": "local", "instance_data_dir": str(dataset)}]
    )
    cfg = tmp_path / "cfg.json"
    cfg.write_bytes(orjson.dumps(raw))
    cfg = str(cfg)
    image = dataset / EDITED

    first = _train(raw, str(tmp_path / "out1"))
    key = first.data.latent_keys[SAMPLE_KEY]
    old = first.data.vae_cache.get(key)["latents"]
    store = ShardedTensorStore(Path(raw["cache_config"]["cache_dir"]) / "sd" / "vae")
    assert store.source_hashes([key]) == {key: source_hash([image.read_bytes()])}  # recorded at encode time

    _edit_in_place(image)

    # The default: same identity, same key, the stale latent is used (the documented blind spot).
    second = _train(raw, str(tmp_path / "out2"))
    assert second.data.latent_keys[SAMPLE_KEY] == key
    assert second.data.fill_reports["latents"].num_computed == 0
    assert torch.equal(second.data.vae_cache.get(key)["latents"], old)

    # `cache verify --content` finds it, by path, and fails like corruption.
    code, out = _verify(cfg, capsys, "--content")
    assert code == 1
    assert "sources: 11 unchanged, 1 changed since encoded" in out and f"changed {image} (entry {key})" in out
    assert "--content --fix" in out and "verify_content: true" in out
    code, payload, caches = _verify_json(cfg, capsys, "--content")
    assert code == 1 and payload["content_checked"] is True
    assert caches["vae"]["content_changed"] == {key: str(image)} and caches["vae"]["num_content_checked"] == 12
    assert caches["vae"]["has_changed_content"] is True and caches["vae"]["corrupt"] == {}
    assert caches["text"]["num_content_checked"] is None  # a text key holds the caption itself
    code, payload, caches = _verify_json(cfg, capsys)  # without --content: identity only, as before
    assert code == 0 and payload["content_checked"] is False and caches["vae"]["content_changed"] == {}

    # verify_content: exactly that latent is re-encoded, and equals a fresh encode of the new image.
    caplog.set_level(logging.INFO, logger="simpletuner.caching.tensor_cache")
    checked = dict(raw, cache_config=dict(raw["cache_config"], verify_content=True))
    third = _train(checked, str(tmp_path / "out3"))
    report = third.data.fill_reports["latents"]
    assert (report.changed, report.unhashed, report.num_computed, report.num_hits) == ((key,), (), 1, 11)
    assert f"re-encoded 1 entries whose source changed: {image}" in caplog.text
    new = third.data.vae_cache.get(key)["latents"]
    fresh = _train(dict(raw, cache_config={"cache_dir": str(tmp_path / "fresh_cache")}), str(tmp_path / "out4"))
    assert torch.allclose(new, fresh.data.vae_cache.get(key)["latents"], atol=1e-5)
    assert not torch.allclose(new, old, atol=1e-3)
    code, _, caches = _verify_json(cfg, capsys, "--content")
    assert code == 0 and caches["vae"]["content_changed"] == {} and caches["vae"]["num_content_unhashed"] == 0

    # --fix removes a changed one; the next (default) run encodes it again.
    _edit_in_place(image)
    code, out = _verify(cfg, capsys, "--content", "--fix")
    assert code == 0 and "removed 1 entries whose source changed; the next run re-encodes them" in out
    code, _, caches = _verify_json(cfg, capsys, "--content")
    assert code == 0 and caches["vae"]["num_missing"] == 1 and caches["vae"]["content_changed"] == {}
    after_fix = _train(raw, str(tmp_path / "out5"))
    assert after_fix.data.fill_reports["latents"].num_computed == 1


def _images(folder: Path, num: int) -> list[Path]:
    folder.mkdir()
    paths = []
    for i in range(num):
        path = folder / f"{i}.bin"
        path.write_bytes(bytes([i]) * 100)
        paths.append(path)
    return paths


def _fill(cache: TensorCache, paths: list[Path], verify: bool):
    """A fill whose 'encoder' is the file's first byte; the source is the file itself."""
    check = SourceCheck(hash=lambda p: source_hash([p.read_bytes()]), name=str, verify=verify)
    return cache.fill(
        [(p.name, p) for p in paths],
        lambda ps: [{"x": torch.tensor([p.read_bytes()[0]])} for p in ps],
        batch_size=2,
        sources=check,
    )


@pytest.mark.parametrize("kind", ["disk", "memory"])
def test_latents_without_a_recorded_hash_are_re_encoded_once_under_verify_content(kind, tmp_path, caplog):
    paths = _images(tmp_path / "src", 3)
    folder = tmp_path / "cache"
    ShardedTensorStore(folder).put_many({p.name: {"x": torch.tensor([9])} for p in paths})  # as before hashes existed

    def open_cache() -> TensorCache:
        disk = ShardedTensorStore(folder)
        return TensorCache(disk if kind == "disk" else MemoryTensorStore("vae", backing=disk), "vae")

    assert _fill(open_cache(), paths, verify=False).num_computed == 0  # off: trusted as they are
    caplog.set_level(logging.WARNING, logger="simpletuner.caching.tensor_cache")
    report = _fill(open_cache(), paths, verify=True)
    assert report.unhashed == tuple(p.name for p in paths) and report.num_computed == 3 and report.changed == ()
    assert "re-encoded 3 entries written before source hashes were recorded" in caplog.text
    cache = open_cache()
    assert [int(cache.get(p.name)["x"]) for p in paths] == [0, 1, 2]
    assert _fill(cache, paths, verify=True).num_computed == 0  # once: they carry hashes now

    paths[1].write_bytes(b"\x07" * 100)
    report = _fill(open_cache(), paths, verify=True)
    assert report.changed == (paths[1].name,) and report.num_computed == 1


def test_rewriting_shards_keeps_the_source_hashes(tmp_path):
    store = ShardedTensorStore(tmp_path / "cache")
    store.put_many({"a": {"x": torch.zeros(2)}, "b": {"x": torch.ones(2)}}, source_hashes={"a": "h-a", "b": "h-b"})
    store.put_many({"c": {"x": torch.ones(3)}})
    assert store.source_hashes(["a", "b", "c", "missing"]) == {"a": "h-a", "b": "h-b", "c": None}
    store.remove(["b"])  # rewrites the shard holding a
    store.compact(keep={"a", "c"})
    reopened = ShardedTensorStore(tmp_path / "cache")
    assert reopened.source_hashes(["a", "b", "c"]) == {"a": "h-a", "c": None}


def test_fix_needs_content_and_refuses_while_a_run_uses_the_cache(make_config, tmp_path, capsys):
    from simpletuner.locks import CacheLocks

    raw = make_config()
    cfg = tmp_path / "cfg.json"
    cfg.write_bytes(orjson.dumps(raw))
    assert main(["verify", "--config", str(cfg), "--fix"]) == 2
    assert "--fix goes with --content" in capsys.readouterr().err

    store = ShardedTensorStore(Path(raw["cache_config"]["cache_dir"]) / "sd" / "vae")
    from simpletuner.cli.cache import needed_keys
    from simpletuner.configuration import load_config

    [key, *_] = sorted(needed_keys(load_config(str(cfg), [], check_files=False).config)["vae"])
    store.put_many({key: {"latents": torch.zeros(4, 8, 8)}}, source_hashes={key: "blake2b-128:" + "0" * 32})
    with CacheLocks(store.root.parent).use():  # a run holds the cache
        assert main(["verify", "--config", str(cfg), "--content", "--fix"]) == 2
        assert "used by a run" in capsys.readouterr().err
    assert key in ShardedTensorStore(store.root)
    assert main(["verify", "--config", str(cfg), "--content", "--fix"]) == 0
    assert key not in ShardedTensorStore(store.root)


def test_a_frame_folder_is_hashed_over_every_frame_it_takes_in_order():
    from types import SimpleNamespace

    from simpletuner.caching.vae_cache import sample_source_hash

    files = {"clip/0.png": b"first", "clip/1.png": b"second"}
    backend = SimpleNamespace(read=lambda path: files[path])
    clip = SimpleNamespace(media="frames", path="clip", frame_paths=("clip/0.png", "clip/1.png"))
    before = sample_source_hash(backend, clip)
    assert before.startswith("blake2b-128:")
    assert (
        sample_source_hash(backend, SimpleNamespace(**{**vars(clip), "frame_paths": clip.frame_paths[::-1]})) != before
    )
    files["clip/1.png"] = b"secont"  # same length, one byte changed
    assert sample_source_hash(backend, clip) != before
