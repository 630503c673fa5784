"""StateTracker: the record of one training run, shared by the entry point, the trainer and the caches.

An ordinary object made per run and passed in explicitly: no class attributes, no module globals, so two
runs in one process never see each other's state. The trainer's builders hand what they build to each other
as arguments; this is where the run is recorded for the seeds, tools and tests.

Who writes what: the entry point fills ``config``, ``raw_config``, ``setting_sources``, ``startup_notes``,
``hub_model``, ``hub_upload`` and ``resume_command`` (the trainer logs and quotes them); the trainer records the
datasets it built
(``register_dataset``; ``get_dataset`` / ``datasets`` read them), the GH200 runtime decisions
(``gh200_runtime_config``, as ``<output_dir>/gh200_runtime.json`` has them); the caches register their folders,
which ``cache_dirs`` lists (a stop keeps a partial fill there) and ``delete_cache_files`` removes.
"""

from __future__ import annotations

import functools
import logging
import shutil
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.data_backend.factory import RegisteredDataset
    from simpletuner.hub import UploadTarget

logger = logging.getLogger(__name__)

#: The trackers alive in this process, only so that ``StateTracker.delete_cache_files()`` called on the
#: class (as seed 002 and SimpleTuner's global registry do) finds their caches. No run reads it.
_LIVE: "weakref.WeakSet[StateTracker]" = weakref.WeakSet()


class _RunOrClassMethod:
    """A method that works on an instance, and on the class for every live instance (the seed's way)."""

    def __init__(self, method):
        self.method = method
        functools.update_wrapper(self, method)

    def __get__(self, instance, owner=None):
        if instance is not None:
            return functools.partial(self.method, instance)
        return functools.partial(self._on_every_run, owner)

    def _on_every_run(self, owner) -> list:
        trackers = list(_LIVE)
        if not trackers:
            logger.warning(
                "%s.%s(): no training run in this process registered a cache; for a config's caches use "
                "`simpletuner cache clear --config CFG.json`",
                owner.__name__,
                self.method.__name__,
            )
        return [item for tracker in trackers for item in self.method(tracker)]


class StateTracker:
    """The run's validated config, raw JSON, datasets, runtime decisions, locks and cache folders."""

    def __init__(self, config: "TrainingConfig", raw_config: Mapping[str, Any] | None = None):
        self.config = config
        self.raw_config: dict[str, Any] = dict(raw_config or {})
        self.gh200_runtime_config: dict[str, Any] = {}
        #: key -> where its value came from, for keys the launcher can also set ("from cfg.json", ...)
        self.setting_sources: dict[str, str] = {}
        #: lines to log once the run's log is open (e.g. what a --preset filled in)
        self.startup_notes: list[str] = []
        #: the command that resumes this run, for the line a stop signal ends with (None: the config key)
        self.resume_command: str | None = None
        #: ``org/name@commit`` where pretrained_model_name_or_path was a hub id (its snapshot folder is the config's
        #: path); None for a local folder
        self.hub_model: str | None = None
        #: push_to_hub: the repo the entry point checked before anything was written (None: the trainer checks it)
        self.hub_upload: "UploadTarget | None" = None
        self._datasets: dict[str, "RegisteredDataset"] = {}
        self._cache_dirs: set[Path] = set()
        _LIVE.add(self)

    # --- datasets ---
    def register_dataset(self, dataset: "RegisteredDataset") -> None:
        """Record a dataset the trainer built; ids are unique within a run."""
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
        """Record the run's GH200 runtime decisions (``RuntimeDecisions.as_record()``)."""
        self.gh200_runtime_config = dict(values)

    # --- caches ---
    def register_cache_dir(self, path: str | Path) -> None:
        """Record a folder a cache of this run writes to, so ``delete_cache_files`` can remove it."""
        self._cache_dirs.add(Path(path))

    @property
    def cache_dirs(self) -> list[Path]:
        return sorted(self._cache_dirs)

    @_RunOrClassMethod
    def delete_cache_files(self) -> list[Path]:
        """Remove every cache folder registered by this run; returns what was removed.

        Called on the class (``StateTracker.delete_cache_files()``, as seed 002 does), it does this for
        every run of this process whose tracker is still alive (none: it warns and names
        ``simpletuner cache clear``)."""
        removed = []
        for path in self.cache_dirs:
            if path.exists():
                shutil.rmtree(path)
                removed.append(path)
                logger.info("removed cache %s", path)
        self._cache_dirs.clear()
        return removed
