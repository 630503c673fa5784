"""Cache keys: stable, sensitive to every component, strict about what they accept."""

import os
from pathlib import Path

import pytest
import torch

from simpletuner.caching import (
    CACHE_FORMAT_VERSION,
    file_stat_identity,
    fingerprint,
    folder_identity,
    latent_cache_key,
    text_cache_key,
)
from simpletuner.caching.fingerprint import canonical_bytes

BASE = dict(
    name="a.png",
    size=(512, 768),
    crop={"top": 0, "left": 16, "flip": False},
    scale=0.18215,
    dtype=torch.float16,
    extra=None,
)


def test_fingerprint_is_stable_and_ignores_dict_order():
    first = fingerprint(**BASE)
    assert first == fingerprint(**BASE)
    reordered = {key: BASE[key] for key in reversed(list(BASE))}
    reordered["crop"] = {"flip": False, "left": 16, "top": 0}
    assert fingerprint(**reordered) == first
    assert len(first) == 32 and int(first, 16) >= 0


def test_fingerprint_includes_format_version():
    assert f'"cache_format_version":{CACHE_FORMAT_VERSION}'.encode() in canonical_bytes(a=1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", "b.png"),
        ("size", (768, 512)),
        ("crop", {"top": 0, "left": 16, "flip": True}),
        ("scale", 0.18216),
        ("dtype", torch.bfloat16),
        ("extra", 0),
    ],
)
def test_fingerprint_changes_with_any_component(field, value):
    assert fingerprint(**{**BASE, field: value}) != fingerprint(**BASE)


def test_fingerprint_keeps_types_apart():
    assert fingerprint(x=1) != fingerprint(x=1.0)
    assert fingerprint(x=1) != fingerprint(x=True)
    assert fingerprint(x="1") != fingerprint(x=1)
    assert fingerprint(x=(1, 2)) == fingerprint(x=[1, 2])
    # a user key that looks like an internal tag cannot collide with a tagged float
    assert fingerprint(x={"$float": "1.0"}) != fingerprint(x=1.0)


@pytest.mark.parametrize("bad", [object(), {1: "a"}, {"a": {1, 2}}, [torch.zeros(1)]])
def test_fingerprint_rejects_unknown_types(bad):
    with pytest.raises(TypeError):
        fingerprint(value=bad)


def test_file_stat_identity(tmp_path):
    path = tmp_path / "img.png"
    path.write_bytes(b"1234")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    assert file_stat_identity(path) == "4:1000000000"
    with pytest.raises(FileNotFoundError):
        file_stat_identity(tmp_path / "missing.png")


def _make_encoder_folder(root: Path) -> Path:
    folder = root / "vae"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"latent_channels": 4}')
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * 64)
    (folder / "sub" / "extra.bin").write_bytes(b"\1" * 8)
    (folder / "README.md").write_text("not part of the identity")
    return folder


def test_folder_identity_tracks_weights_and_json_content(tmp_path):
    folder = _make_encoder_folder(tmp_path)
    first = folder_identity(folder)
    assert folder_identity(folder) == first

    (folder / "README.md").write_text("changed")
    assert folder_identity(folder) == first

    weights = folder / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"\0" * 65)
    after_weights = folder_identity(folder)
    assert after_weights != first

    config = folder / "config.json"
    stat = config.stat()
    config.write_text('{"latent_channels": 8}')  # same size
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and same mtime
    assert folder_identity(folder) != after_weights

    (folder / "sub" / "extra.bin").unlink()
    assert folder_identity(folder) != after_weights


def test_folder_identity_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        folder_identity(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no file matching"):
        folder_identity(tmp_path / "empty")


LATENT = dict(
    sample_key="cats/a.png",
    file_identity="1234:99",
    bucket=(512, 512),
    crop={"top": 0, "left": 0},
    resolution=512,
    encoder_identity="vae-abc",
    dtype="float16",
)


@pytest.mark.parametrize(
    "field, value",
    [
        ("sample_key", "cats/b.png"),
        ("file_identity", "1234:100"),
        ("bucket", (512, 448)),
        ("crop", {"top": 8, "left": 0}),
        ("resolution", 1024),
        ("encoder_identity", "vae-def"),
        ("dtype", "bfloat16"),
    ],
)
def test_latent_key_covers_every_component(field, value):
    assert latent_cache_key(**{**LATENT, field: value}) != latent_cache_key(**LATENT)


def test_latent_key_rejects_bad_bucket():
    with pytest.raises(ValueError, match="bucket"):
        latent_cache_key(**{**LATENT, "bucket": (512, 0)})


def test_text_key():
    base = dict(caption="a cat", encoder_identity="clip-1", dtype="float16", max_length=77)
    key = text_cache_key(**base)
    assert key == text_cache_key(**base)
    for field, value in [
        ("caption", "a dog"),
        ("encoder_identity", "clip-2"),
        ("dtype", "float32"),
        ("max_length", None),
    ]:
        assert text_cache_key(**{**base, field: value}) != key
    assert text_cache_key(**base) != latent_cache_key(**LATENT)
    with pytest.raises(ValueError, match="max_length"):
        text_cache_key(**{**base, "max_length": 0})
