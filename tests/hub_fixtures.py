"""Hugging Face Hub stand-ins for tests: a Hub cache laid out as huggingface_hub lays one out; client switches.

Usage. ``commit = lay_out_hub_cache(cache_dir, "org/name", {"model_index.json": b"{}", "unet/w.safetensors": path})``
writes ``cache_dir/models--org--name/{blobs,refs,snapshots,trees}`` exactly as ``snapshot_download`` leaves it
(``repo_type="dataset"`` gives ``datasets--org--name``; ``revision`` names the ref, ``commit`` fixes the hash, else it
is derived from the content); the real client then finds it with ``snapshot_download("org/name", cache_dir=cache_dir,
local_files_only=True)`` or, under ``HF_HUB_OFFLINE=1`` (the suite's default), without ``local_files_only``.
``copy_folder_to_hub_cache(cache_dir, "org/name", folder)`` puts a whole local folder (e.g. a tiny zoo model from
``simpletuner.testing.zoo.write_tiny_model``) into a repo. ``use_hub_cache(monkeypatch, cache_dir)`` makes that folder
the process's default Hub cache for one test (``HF_HUB_CACHE`` in the environment and in
``huggingface_hub.constants``, which reads it at import), so code that passes no ``cache_dir`` finds it.
``hub_online(monkeypatch)`` turns the suite's ``HF_HUB_OFFLINE=1`` off for one test. The online path (a local Hub
server on 127.0.0.1 and the ``hub_server`` fixture) is in hub_server.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

# Files the Hub's default .gitattributes sends to LFS (their ETag is the content's sha256, not the git blob id).
LFS_SUFFIXES = frozenset(
    ".7z .arrow .bin .bz2 .ckpt .ftz .gguf .gz .h5 .joblib .lz4 .mlmodel .model .msgpack .npy .npz .onnx .ot"
    " .parquet .pb .pickle .pkl .pt .pth .rar .safetensors .tar .tflite .tgz .wasm .xz .zip .zst"
    " .jpg .jpeg .png .webp .gif .mp4 .webm .wav .mp3 .flac".split()
)
_LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub refuses larger non-LFS files: anything this big is LFS
_CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by huggingface_hub.\n"
    "# For information about cache directory tags, see:\n"
    "#\thttps://bford.info/cachedir/\n"
)


def is_lfs_path(path: str, size: int) -> bool:
    """Whether the Hub keeps this file in LFS (by its default .gitattributes, or by size)."""
    return Path(path).suffix.lower() in LFS_SUFFIXES or size >= _LFS_MIN_SIZE


@dataclass(frozen=True)
class HubFile:
    """One file of a repo as the Hub describes it: git blob id, LFS sha256 (None for a plain git file), ETag."""

    path: str
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def blob_id(self) -> str:
        """The git blob id: of the content, or of the LFS pointer file for an LFS file (as git stores it)."""
        body = self.data if self.lfs_sha256 is None else self.lfs_pointer
        return hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()

    @property
    def lfs_pointer(self) -> bytes:
        sha = hashlib.sha256(self.data).hexdigest()
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {self.size}\n".encode()

    @property
    def lfs_sha256(self) -> str | None:
        if self.size and is_lfs_path(self.path, self.size):
            return hashlib.sha256(self.data).hexdigest()
        return None

    @property
    def etag(self) -> str:
        """The blob's name in the cache: what the Hub sends as ``X-Linked-Etag`` (LFS) or ``ETag`` (git)."""
        return self.lfs_sha256 or self.blob_id


def hub_files(files: dict[str, bytes | Path]) -> list[HubFile]:
    """``{repo path: bytes or a local file}`` -> HubFiles sorted by path (paths use ``/``, no leading slash)."""
    out = []
    for path, content in sorted(files.items()):
        if path.startswith("/") or "\\" in path or ".." in path.split("/"):
            raise ValueError(f"not a repo path: {path!r}")
        out.append(HubFile(path, content if isinstance(content, bytes) else Path(content).read_bytes()))
    return out


def commit_hash_for(repo_id: str, repo_type: str, files: list[HubFile]) -> str:
    """A 40-hex commit hash derived from the repo and its content (same content -> same hash)."""
    digest = hashlib.sha1(f"{repo_type}:{repo_id}\n".encode())
    for f in files:
        digest.update(f"{f.path}\0{f.etag}\n".encode())
    return digest.hexdigest()


def repo_folder(cache_dir: str | Path, repo_id: str, repo_type: str = "model") -> Path:
    """``cache_dir/models--org--name`` (``datasets--``, ``spaces--``): where huggingface_hub keeps one repo."""
    return Path(cache_dir) / "--".join([f"{repo_type}s", *repo_id.split("/")])


def _link_or_copy(blob: Path, pointer: Path) -> None:
    """A relative symlink from the snapshot to the blob, or a copy where huggingface_hub would copy."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.unlink(missing_ok=True)
    from huggingface_hub import constants

    if not constants.HF_HUB_DISABLE_SYMLINKS:
        try:
            os.symlink(os.path.relpath(blob, pointer.parent), pointer)
            return
        except OSError:
            pass
    shutil.copyfile(blob, pointer)


def lay_out_hub_cache(
    cache_dir: Path,
    repo_id: str,
    files: dict[str, bytes | Path],
    *,
    repo_type: str = "model",
    revision: str = "main",
    commit: str | None = None,
    tree_listing: bool = True,
) -> str:
    """Write ``files`` into ``cache_dir`` as one revision of ``repo_id`` and return its commit hash.

    Layout (huggingface_hub 2.x, as after ``snapshot_download``): ``blobs/<etag>`` holds each file's bytes,
    ``refs/<revision>`` the commit hash (none when ``revision`` is itself the commit hash),
    ``snapshots/<commit>/<path>`` a relative symlink to the blob (a copy where symlinks are off), and
    ``trees/<commit>.json`` the tree listing (``tree_listing=False`` leaves it out, as after ``hf_hub_download``:
    then an offline ``snapshot_download`` cannot tell a partial snapshot). Other revisions already there stay.
    """
    entries = hub_files(files)
    commit = commit or commit_hash_for(repo_id, repo_type, entries)
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise ValueError(f"commit must be 40 lowercase hex digits, not {commit!r}")
    cache_dir = Path(cache_dir)
    storage = repo_folder(cache_dir, repo_id, repo_type)
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    tag = cache_dir / "CACHEDIR.TAG"
    if not tag.exists():
        tag.write_text(_CACHEDIR_TAG)
    for f in entries:
        blob = storage / "blobs" / f.etag
        if not blob.exists():
            blob.write_bytes(f.data)
        _link_or_copy(blob, storage / "snapshots" / commit / Path(*f.path.split("/")))
    (storage / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    if revision != commit:
        ref = storage / "refs" / Path(*revision.split("/"))
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    if tree_listing:
        listing = {"format_version": 1, "files": {f.path: _tree_entry(f) for f in entries}}
        (storage / "trees").mkdir(exist_ok=True)
        (storage / "trees" / f"{commit}.json").write_text(json.dumps(listing, indent=1))
    return commit


def _tree_entry(f: HubFile) -> dict[str, object]:
    entry: dict[str, object] = {"size": f.size, "blob_id": f.blob_id}
    if f.lfs_sha256 is not None:
        entry.update(lfs_sha256=f.lfs_sha256, lfs_size=f.size)
    return entry


def folder_files(folder: str | Path) -> dict[str, bytes | Path]:
    """Every file under ``folder`` as ``{relative posix path: Path}`` (the ``files`` argument of the writers)."""
    root = Path(folder)
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def copy_folder_to_hub_cache(
    cache_dir: Path,
    repo_id: str,
    folder: str | Path,
    *,
    repo_type: str = "model",
    revision: str = "main",
    commit: str | None = None,
) -> str:
    """Lay out every file under ``folder`` (e.g. a tiny diffusers model) as ``repo_id`` in the cache; the commit."""
    return lay_out_hub_cache(
        cache_dir, repo_id, folder_files(folder), repo_type=repo_type, revision=revision, commit=commit
    )


def use_hub_cache(monkeypatch: pytest.MonkeyPatch, cache_dir: str | Path) -> Path:
    """Make ``cache_dir`` the default Hub cache for this test: ``HF_HUB_CACHE`` in the environment (subprocesses)
    and ``huggingface_hub.constants.HF_HUB_CACHE`` (read at import; ``snapshot_download`` without ``cache_dir``
    reads it at call time)."""
    from huggingface_hub import constants

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def hub_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn huggingface_hub's offline mode off for one test (the suite's environment sets ``HF_HUB_OFFLINE=1``):
    the environment, ``constants.HF_HUB_OFFLINE`` (read at import; every request checks it) and the copies diffusers
    took at import (``from huggingface_hub.constants import HF_HUB_OFFLINE``) in modules already imported."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("diffusers.loaders.lora_base", "diffusers.utils.hub_utils"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "HF_HUB_OFFLINE"):
            monkeypatch.setattr(module, "HF_HUB_OFFLINE", False)
