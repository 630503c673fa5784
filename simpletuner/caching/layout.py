"""Where a model's caches live on disk: the one place training, re-encoding and ``simpletuner cache`` read it.

::

    <cache_dir>/<family>/             cache_base(cache_dir, family): held by simpletuner.locks
        vae/                          VAE latents (VAE_CACHE_NAME)
        text/                         text embeddings (TEXT_CACHE_NAME)
        vae-epochs/rank-<r>-of-<n>/   refresh_each_epoch: one epoch's latents per process (epoch_folder)

A dataset's ``cache_dir_vae`` and ``cache_config.text_cache_dir`` move those caches elsewhere
(:mod:`simpletuner.caching.routing`).
"""

from __future__ import annotations

import os
from pathlib import Path

#: The encode-once caches of a model, by folder name.
VAE_CACHE_NAME = "vae"
TEXT_CACHE_NAME = "text"
CACHE_NAMES = (VAE_CACHE_NAME, TEXT_CACHE_NAME)

#: Folder (beside ``vae`` and ``text``) of the per-epoch latents of ``refresh_each_epoch``.
EPOCH_CACHE_NAME = "vae-epochs"


def cache_base(cache_dir: str | os.PathLike[str], family: str) -> Path:
    """``<cache_dir>/<family>`` (``~`` expanded; relative to the working directory)."""
    return Path(cache_dir).expanduser() / family


def epoch_folder(base: str | os.PathLike[str], rank: int, num_replicas: int) -> Path:
    """The folder of per-epoch latents only process ``rank`` of ``num_replicas`` writes, under ``base``
    (a :func:`cache_base`)."""
    return Path(base) / EPOCH_CACHE_NAME / f"rank-{rank}-of-{num_replicas}"
