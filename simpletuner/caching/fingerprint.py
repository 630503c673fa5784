"""Cache keys: a stable fingerprint of everything that changes a cached value.

A key must change whenever its value could: the source file, crop and resolution, the encoder, the dtype
and the code that stores it (``CACHE_FORMAT_VERSION``); anything it misses is a silent stale hit. So the
canonical form (orjson, sorted keys) is strict: tagged objects carry what JSON cannot carry exactly
(floats as ``repr``, so ``1`` and ``1.0`` differ; ``torch.dtype`` by name; ``bytes`` as hex; a user key
starting with ``$`` is escaped), and a value it cannot encode raises ``TypeError``, never ``str()``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path, PurePath
from typing import Any, Iterable, Mapping

import orjson
import torch

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
"""Bump when the on-disk cache layout or the encoding code changes: it is part of every key."""

_FINGERPRINT_HEX_CHARS = 32
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_TAG_PREFIX = "$"


def _canonical(value: Any, where: str) -> Any:
    """Turn ``value`` into plain JSON types, tagging anything JSON would lose or blur."""
    # bool before int: bool is an int subclass and JSON keeps true/false apart already.
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if _INT64_MIN <= value <= _INT64_MAX:
            return int(value)
        return {"$int": str(int(value))}
    if isinstance(value, float):
        return {"$float": repr(float(value))}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, PurePath):
        return {"$path": value.as_posix()}
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"fingerprint: dict key {key!r} at {where} is {type(key).__name__}; keys must be str")
            safe_key = _TAG_PREFIX + key if key.startswith(_TAG_PREFIX) else key
            out[safe_key] = _canonical(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(
        f"fingerprint: cannot serialise {type(value).__module__}.{type(value).__qualname__} at {where}; "
        "pass str, int, float, bool, None, bytes, Path, torch.dtype, or lists/tuples/dicts of them"
    )


def canonical_bytes(**components: Any) -> bytes:
    """The exact bytes :func:`fingerprint` hashes (exposed for debugging a surprising miss)."""
    payload = {
        "cache_format_version": CACHE_FORMAT_VERSION,
        "components": _canonical(components, "components"),
    }
    return orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)


def fingerprint(**components: Any) -> str:
    """A 32-hex-char sha256 fingerprint of ``components`` plus ``CACHE_FORMAT_VERSION``.

    Stable across processes, platforms and keyword order. Supported values: ``str``,
    ``int``, ``float``, ``bool``, ``None``, ``bytes``, ``pathlib`` paths, ``torch.dtype``,
    and lists, tuples (hashed as lists) and str-keyed dicts of those.

    Raises:
        TypeError: a value (at any depth) is of another type, or a dict key is not a str.
    """
    return hashlib.sha256(canonical_bytes(**components)).hexdigest()[:_FINGERPRINT_HEX_CHARS]


def file_stat_identity(path: str | os.PathLike[str]) -> str:
    """``"{size}:{mtime_ns}"`` of a local file: cheap, changes when the file is rewritten.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    stat = os.stat(path)
    return f"{stat.st_size}:{stat.st_mtime_ns}"


SOURCE_HASH_NAME = "blake2b-128"
"""The algorithm of :func:`source_hash`; part of every stored value, so a change of algorithm
reads as a changed source (a re-encode), never as a match."""


def source_hash(parts: Iterable[bytes]) -> str:
    """``"blake2b-128:<32 hex>"`` over ``parts`` (a file's bytes, or each frame's path and bytes).

    What a cache entry was encoded from, by content: the key holds only the file's identity
    (size + mtime), which an in-place edit that keeps both does not change. Each part is
    length-prefixed so ``[b"ab", b"c"]`` and ``[b"a", b"bc"]`` differ. blake2b in the stdlib
    hashes ~1 GB/s on one core and releases the GIL for large inputs.
    """
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return f"{SOURCE_HASH_NAME}:{digest.hexdigest()}"


def _matching_files(folder: Path, patterns: Iterable[str]) -> list[Path]:
    found: set[Path] = set()
    for pattern in patterns:
        found.update(p for p in folder.rglob(pattern) if p.is_file())
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def folder_identity(
    folder: str | os.PathLike[str],
    patterns: tuple[str, ...] = ("*.json", "*.safetensors", "*.bin"),
) -> str:
    """Identity of an encoder saved in ``folder`` (for example a model's ``vae/`` subfolder).

    A fingerprint over the relative name, size and mtime of every file matching
    ``patterns`` (searched recursively), plus the content of each ``*.json`` file, so a
    changed config is seen even when a copy kept its timestamps. Weights are not read:
    hashing gigabytes on every start would cost more than a re-encode is worth guarding.

    Raises:
        ValueError: ``folder`` does not exist, is not a folder, or holds no matching file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"encoder folder {folder} does not exist or is not a folder")
    files = _matching_files(folder, patterns)
    if not files:
        raise ValueError(
            f"encoder folder {folder} holds no file matching {list(patterns)}; "
            "point it at a diffusers-format component folder (config.json + weights)"
        )
    entries = []
    for path in files:
        stat = path.stat()
        entry: dict[str, Any] = {
            "name": path.relative_to(folder).as_posix(),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
        }
        if path.suffix == ".json":
            entry["content_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        entries.append(entry)
    logger.debug("folder identity of %s over %d files", folder, len(entries))
    return fingerprint(kind="folder-identity", patterns=list(patterns), files=entries)
