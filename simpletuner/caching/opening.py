"""Opening caches: a :class:`~simpletuner.caching.tensor_cache.TensorCache` over the store a cache type
names (`disk`; `memory` / `unified_memory`, optionally written through to disk), one folder or a
model's ``(vae, text)`` pair."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from simpletuner.caching.base import RecordCacheDir, TensorStore
from simpletuner.caching.layout import TEXT_CACHE_NAME, VAE_CACHE_NAME, cache_base
from simpletuner.caching.memory_store import MemoryTensorStore
from simpletuner.caching.store import ShardedTensorStore
from simpletuner.caching.tensor_cache import TensorCache
from simpletuner.gh200.uvm import cache_type_in_use, prefetch_to_device, stack_unified, to_unified

CACHE_TYPES = ("disk", "memory", "unified_memory")
#: Where a unified-memory cache's entries prefer to reside.
Residency = Literal["cpu", "gpu"]
_MODEL_TAG_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def _check_cache_types(*kinds: str) -> None:
    """Raises ValueError naming the first of ``kinds`` that is not a cache type (before any folder is made)."""
    for kind in kinds:
        if kind not in CACHE_TYPES:
            raise ValueError(f"cache type {kind!r} is not one of {', '.join(CACHE_TYPES)}")


def _open_store(folder: Path, kind: str, name: str, persistent: bool, prefer: Residency) -> TensorStore:
    """A disk store, or a memory store (optionally backed by disk) placed per ``kind`` (one of
    :data:`CACHE_TYPES`, checked by the caller)."""
    kind = cache_type_in_use(kind)
    if kind == "disk":
        return ShardedTensorStore(folder)
    backing = ShardedTensorStore(folder) if persistent else None
    if kind == "memory":
        return MemoryTensorStore(name, backing=backing)
    return MemoryTensorStore(
        name,
        place=lambda t: to_unified(t, prefer),
        prefetch=prefetch_to_device,
        backing=backing,
        stack=stack_unified,
    )


def open_tensor_cache(
    folder: str | os.PathLike[str],
    kind: str,
    name: str,
    persistent: bool = True,
    prefer: Residency = "cpu",
    verify: bool = True,
) -> TensorCache:
    """One :class:`TensorCache` in ``folder`` of cache type ``kind`` (`disk`, `memory`,
    `unified_memory`; memory ones written through to ``folder`` when ``persistent``). A
    `unified_memory` cache is a `memory` one while hints are forced off (:func:`cache_type_in_use`).

    Raises:
        ValueError: an unknown cache type.
    """
    _check_cache_types(kind)
    return TensorCache(_open_store(Path(folder), kind, name, persistent, prefer), name, verify=verify)


def open_caches(
    cache_dir: str | os.PathLike[str],
    model_tag: str,
    record_cache_dir: RecordCacheDir | None = None,
    vae_type: str = "disk",
    text_type: str = "disk",
    persistent: bool = True,
    verify: bool = True,
) -> tuple[TensorCache, TensorCache]:
    """Open the ``(vae_cache, text_cache)`` pair of a model in ``cache_dir/model_tag/{vae,text}``.

    Each folder that holds files is passed to ``record_cache_dir`` (e.g. ``StateTracker.register_cache_dir``).
    ``vae_type`` / ``text_type``: ``disk``, ``memory`` or ``unified_memory`` (see :func:`cache_type_in_use`);
    memory stores are written through to disk when ``persistent`` (one disk format for both). ``verify``:
    check each needed entry's checksum when filling (:class:`TensorCache`).

    Raises:
        ValueError: ``model_tag`` is not a plain folder name (letters, digits, ``._-``), or an unknown cache type.
    """
    if not isinstance(model_tag, str) or not _MODEL_TAG_PATTERN.match(model_tag):
        raise ValueError(
            f"model_tag {model_tag!r} must be a plain folder name of letters, digits, '.', '_' or '-' "
            "(not starting with '.' or '-')"
        )
    _check_cache_types(vae_type, text_type)
    base = cache_base(cache_dir, model_tag)
    vae_dir, text_dir = base / VAE_CACHE_NAME, base / TEXT_CACHE_NAME
    vae_cache = TensorCache(_open_store(vae_dir, vae_type, "vae", persistent, "cpu"), "vae", verify=verify)
    text_cache = TensorCache(_open_store(text_dir, text_type, "text", persistent, "gpu"), "text", verify=verify)
    if record_cache_dir is not None:
        for folder, kind in ((vae_dir, vae_type), (text_dir, text_type)):
            if kind == "disk" or persistent:
                record_cache_dir(folder)
    return vae_cache, text_cache
