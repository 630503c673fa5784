"""Which folder holds which cache of a run: per-dataset latent folders and the text-embedding folder.

By default ``<cache_dir>/<family>/{vae,text}`` (:mod:`.layout`); a dataset's ``cache_dir_vae`` and
``cache_config.text_cache_dir`` move them (:mod:`simpletuner.configuration.cache_paths`). Such a folder
holds its store's shards and its own cache locks directly, and datasets naming one folder share its store.
The cache fill (:mod:`simpletuner.caching.plan`) and ``simpletuner cache`` both build a :class:`CacheFolders`
here, so they agree on where every latent lives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from simpletuner.caching.base import RecordCacheDir
from simpletuner.caching.keys import CacheKeys
from simpletuner.caching.layout import TEXT_CACHE_NAME, VAE_CACHE_NAME, cache_base
from simpletuner.caching.opening import Residency, open_tensor_cache
from simpletuner.caching.tensor_cache import FillReport, TensorCache
from simpletuner.configuration.cache_paths import fill_template, trained_datasets


def _same(a: Path, b: Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


@dataclass(frozen=True)
class CacheFolders:
    """Where one config's caches live.

    Attributes:
        base: ``<cache_dir>/<family>``: the default folders, the per-epoch latents, and their locks.
        default_vae: ``base/vae``, the latents of every dataset without ``cache_dir_vae``.
        text: the text-embedding folder (``base/text`` unless ``text_cache_dir`` names another).
        dataset_vae: dataset id -> its latent folder, for the datasets with a ``cache_dir_vae`` (filled in).
    """

    base: Path
    default_vae: Path
    text: Path
    dataset_vae: Mapping[str, Path] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Any, family: str, cache_dir: str | os.PathLike[str] | None = None) -> "CacheFolders":
        """The folders of ``config``'s trained datasets for model ``family`` (``cache_dir``: the
        config's ``cache_config.cache_dir`` unless given)."""
        base = cache_base(config.cache_config.cache_dir if cache_dir is None else cache_dir, family)
        default_vae = base / VAE_CACHE_NAME

        def filled(template: str, dataset_id: str | None = None) -> Path:
            text = fill_template(template, model_family=family, output_dir=config.output_dir, dataset_id=dataset_id)
            return Path(text).expanduser()

        text_dir = config.cache_config.text_cache_dir
        text = filled(text_dir) if text_dir else base / TEXT_CACHE_NAME
        dataset_vae = {}
        for dataset in trained_datasets(config):
            if dataset.cache_dir_vae:
                folder = Path(os.path.abspath(filled(dataset.cache_dir_vae, dataset.id)))  # one spelling per folder
                if not _same(folder, default_vae):
                    dataset_vae[dataset.id] = folder
        return cls(base, default_vae, text, dataset_vae)

    def vae_folder(self, dataset_id: str) -> Path:
        """The folder of ``dataset_id``'s latents."""
        return self.dataset_vae.get(dataset_id, self.default_vae)

    def vae_folders(self, dataset_ids: Iterable[str]) -> list[Path]:
        """The distinct latent folders ``dataset_ids`` use, in their order."""
        folders: list[Path] = []
        for dataset_id in dataset_ids:
            folder = self.vae_folder(dataset_id)
            if not any(_same(folder, f) for f in folders):
                folders.append(folder)
        return folders

    def all_vae_folders(self) -> list[Path]:
        """The default latent folder, then every dataset's own (distinct): what ``simpletuner cache`` lists."""
        return self.vae_folders(["", *self.dataset_vae])  # "" is no dataset: the default folder

    def is_custom(self, folder: Path) -> bool:
        """True for a folder a config key named (it holds its own locks), False for ``base/vae`` or ``base/text``."""
        return not any(_same(folder, self.base / name) for name in (VAE_CACHE_NAME, TEXT_CACHE_NAME))

    def lock_base(self, folder: Path) -> Path:
        """The folder whose :class:`~simpletuner.locks.CacheLocks` cover ``folder``: ``base`` for the
        default folders, the folder itself for one a config key named."""
        return folder if self.is_custom(folder) else self.base

    def latents_by_folder(self, keys: CacheKeys) -> dict[Path, set[str]]:
        """Latent folder -> the latent keys of ``keys`` stored there (every folder of
        :meth:`all_vae_folders`, empty sets included)."""
        out: dict[Path, set[str]] = {folder: set() for folder in self.all_vae_folders()}
        for key, (dataset, _) in keys.latent_sources().items():
            folder = self.vae_folder(dataset.id)
            out.setdefault(folder, set()).add(key)
        return out


def open_folder_cache(
    folder: Path,
    kind: str,
    name: str,
    persistent: bool,
    record_cache_dir: RecordCacheDir | None = None,
    verify: bool = True,
) -> TensorCache:
    """A :class:`TensorCache` in ``folder`` (``name``: ``vae`` keeps entries in CPU memory, ``text`` prefers
    the GPU, as :func:`~simpletuner.caching.opening.open_caches` places them), passed to
    ``record_cache_dir`` when it writes to disk."""
    prefer: Residency = "cpu" if name == VAE_CACHE_NAME else "gpu"
    cache = open_tensor_cache(folder, kind, name, persistent, prefer, verify=verify)
    if record_cache_dir is not None and (kind == "disk" or persistent):
        record_cache_dir(folder)
    return cache


def merge_fill_reports(reports: list[FillReport]) -> FillReport:
    """One :class:`FillReport` for fills of several folders (their counts and key lists added up)."""
    if len(reports) == 1:
        return reports[0]
    return FillReport(
        num_items=sum(r.num_items for r in reports),
        num_hits=sum(r.num_hits for r in reports),
        num_computed=sum(r.num_computed for r in reports),
        seconds=sum(r.seconds for r in reports),
        failed=tuple(k for r in reports for k in r.failed),
        corrupt=tuple(k for r in reports for k in r.corrupt),
        changed=tuple(k for r in reports for k in r.changed),
        unhashed=tuple(k for r in reports for k in r.unhashed),
    )
