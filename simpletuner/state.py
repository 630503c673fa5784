"""StateTracker: the registry one training run shares between trainer, data factory and caches.

An ordinary object made per run and passed in explicitly: no class attributes, no module
globals, so two runs in one process never see each other's state.

Who reads what: the trainer builds its samplers and caches from ``datasets`` (the factory
registers them), shows ``cache_dirs`` when a stop keeps a partial cache fill, logs
``setting_sources`` / ``startup_notes`` (the entry point fills them) and holds ``run_locks``, which
the cache fill adds its locks to. ``gh200_runtime_config`` (also written to
``<output_dir>/gh200_runtime.json``), ``get_dataset`` and ``delete_cache_files`` serve tools and
tests: training itself never uses them.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.data_backend.factory import RegisteredDataset

logger = logging.getLogger(__name__)


class StateTracker:
    """Holds the validated config, the raw JSON, the registered datasets and runtime decisions."""

    def __init__(self, config: "TrainingConfig", raw_config: Mapping[str, Any] | None = None):
        self.config = config
        self.raw_config: dict[str, Any] = dict(raw_config or {})
        self.gh200_runtime_config: dict[str, Any] = {}
        #: key -> where its value came from, for keys the launcher can also set ("from cfg.json", ...)
        self.setting_sources: dict[str, str] = {}
        #: lines to log once the run's log is open (e.g. what a --preset filled in)
        self.startup_notes: list[str] = []
        #: locks held until the run ends (the trainer's output_dir lock, then the cache folders')
        self.run_locks: ExitStack | None = None
        self._datasets: dict[str, "RegisteredDataset"] = {}
        self._cache_dirs: set[Path] = set()

    # --- datasets ---
    def register_dataset(self, dataset: "RegisteredDataset") -> None:
        """Add a dataset built by the factory; ids are unique within a run."""
        if dataset.id in self._datasets:
            raise ValueError(f"dataset id {dataset.id!r} is registered twice")
        self._datasets[dataset.id] = dataset

    def get_dataset(self, dataset_id: str) -> "RegisteredDataset":
        try:
            return self._datasets[dataset_id]
        except KeyError:
            raise KeyError(f"no dataset {dataset_id!r}; registered: {sorted(self._datasets)}") from None

    @property
    def datasets(self) -> list["RegisteredDataset"]:
        return list(self._datasets.values())

    # --- runtime decisions ---
    def set_gh200_runtime_config(self, values: Mapping[str, Any]) -> None:
        self.gh200_runtime_config = dict(values)

    # --- caches ---
    def register_cache_dir(self, path: str | Path) -> None:
        """Record a folder a cache of this run writes to, so ``delete_cache_files`` can remove it."""
        self._cache_dirs.add(Path(path))

    @property
    def cache_dirs(self) -> list[Path]:
        return sorted(self._cache_dirs)

    def delete_cache_files(self) -> list[Path]:
        """Remove every cache folder registered by this run; returns what was removed."""
        removed = []
        for path in self.cache_dirs:
            if path.exists():
                shutil.rmtree(path)
                removed.append(path)
                logger.info("removed cache %s", path)
        self._cache_dirs.clear()
        return removed
