"""The plan of a run's cache fill (:class:`CachePlan`): the cache mode in effect, the folders, which of
them this process cannot write, the caches opened there, the locks the run holds on the others, the
processes sharing the work, and every key the run reads.

Locks (:mod:`simpletuner.locks`), for caches on disk: each writable cache folder is held shared from
the plan until the run ends (entered into the run's lock stack), a fill with something to encode
holds the folder's writer lock (:meth:`CachePlan.writing`: a second run waits, then encodes only what
is still missing), and ``refresh_each_epoch`` holds this process's per-epoch folder. A latent folder
of a dataset's own (``cache_dir_vae``) or a ``text_cache_dir`` holds its own locks, taken the same way.
A folder this process cannot write is read without locks (:mod:`simpletuner.caching.read_only`).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch

from simpletuner.caching.base import RecordCacheDir
from simpletuner.caching.encoders import CacheEncoders
from simpletuner.caching.keys import cache_keys
from simpletuner.caching.layout import cache_base, epoch_folder
from simpletuner.caching.read_only import ReadOnlyCaches
from simpletuner.caching.routing import CacheFolders, open_folder_cache
from simpletuner.caching.share import FillShare, shares_folder
from simpletuner.caching.store import ShardedTensorStore
from simpletuner.caching.tensor_cache import TensorCache
from simpletuner.data_backend import RegisteredDataset
from simpletuner.locks import CacheLocks, hold_epoch_folder

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)


def cache_mode(config: TrainingConfig) -> str:
    """The effective ``augmentations_cache_mode``: re-encoding without augmentations changes nothing."""
    mode = config.augmentations_cache_mode
    if mode == "refresh_each_epoch" and not config.augmentations.is_enabled:
        logger.warning(
            "augmentations_cache_mode 'refresh_each_epoch' without augmentations would re-encode the "
            "same latents every epoch: caching them once instead (`static`)"
        )
        return "static"
    return mode


def _epoch_folder(base: Path) -> Path:
    """This process's folder of per-epoch latents (as :class:`~simpletuner.caching.reencode.Reencoder`
    names it from the sampler's rank)."""
    from accelerate import PartialState

    process = PartialState()
    return epoch_folder(base, process.process_index, process.num_processes)


class CachePlan:
    """The plan phase of a cache fill, made in the order its steps need: the folders, which of them
    are read-only, the caches opened in them, the locks (entered into ``locks``, the run's stack, when
    given), whether the processes of ``share`` see one folder (``share`` is None otherwise), the keys.

    Attributes: ``config``, ``mode`` (:func:`cache_mode`), ``folders`` and ``vae_folders`` (the distinct
    latent folders of the datasets), ``read_only``, ``vae_caches`` (latent folder -> its cache, as
    opened), ``text_cache``, ``share``, ``keys`` (:func:`~simpletuner.caching.keys.cache_keys`).
    """

    def __init__(
        self,
        spec: CacheEncoders,
        datasets: list[RegisteredDataset],
        cache_dir: Path,
        text_dtype: torch.dtype,
        *,
        locks: ExitStack | None,
        record_cache_dir: RecordCacheDir | None,
        share: FillShare | None = None,
    ):
        self.config = config = spec.config
        self.cache_dir, self.record_cache_dir = Path(cache_dir).expanduser(), record_cache_dir
        self.mode = cache_mode(config)
        self.folders = folders = CacheFolders.of(config, spec.family, cache_dir)
        if self.mode != "static":  # latents are re-encoded while training: no latent folder is read
            self.folders = folders = CacheFolders(folders.base, folders.default_vae, folders.text)
        self.vae_folders = folders.vae_folders(ds.id for ds in datasets)
        cache = config.cache_config
        self.is_on_disk = cache.persistent_cache or "disk" in (cache.vae_cache_type, cache.text_cache_type)
        all_folders = [*self.vae_folders, folders.text]
        lock_bases = sorted({folders.lock_base(f) for f in all_folders}) if self.is_on_disk else []
        self.read_only = ReadOnlyCaches(lock_bases)  # read without locks; everything needed must be there
        self.vae_caches = {folder: self.open_vae(folder) for folder in self.vae_folders}
        self.text_cache = self.open_text()
        self._locks = {base: CacheLocks(base) for base in lock_bases if base not in self.read_only}  # one order
        if locks is not None:  # in use from here until the run ends: `cache clear` refuses
            for folder_locks in self._locks.values():
                locks.enter_context(folder_locks.use())
        written = [f for f in all_folders if folders.lock_base(f) not in self.read_only]
        self.share = share if share is None or self._is_one_folder(share, written) else None
        if (
            self.mode == "refresh_each_epoch"
            and locks is not None
            and (cache.persistent_cache or cache.vae_cache_type == "disk")
        ):
            locks.enter_context(hold_epoch_folder(_epoch_folder(cache_base(cache_dir, spec.family))))
        self.keys = cache_keys(spec, datasets, text_dtype, latents=self.mode == "static")  # as `simpletuner cache`

    def _is_one_folder(self, share: FillShare, written: list[Path]) -> bool:
        """Whether every process sees the folders the fill writes as one folder (warns when not)."""
        if not self.is_on_disk or all(share.sees_one_folder(f) for f in written):
            return True
        logger.warning(
            "the cache folders (%s) are not one folder for every process (a node-local disk at that path on some "
            "node): every process fills the whole cache itself, one at a time per folder. Put cache_dir on a "
            "file system every node mounts to share the encoding (documentation/DISTRIBUTED.md)",
            self.folders.base,
        )
        return False

    def open_vae(self, folder: Path) -> TensorCache:
        """The latent cache in ``folder`` (opened again: what other runs stored since is indexed)."""
        cache = self.config.cache_config
        with self.read_only.refusing_writes(self.folders.lock_base(folder)):
            return open_folder_cache(folder, cache.vae_cache_type, "vae", cache.persistent_cache, self.record_cache_dir)

    def open_text(self) -> TensorCache:
        """The text-embedding cache (opened again, as :meth:`open_vae`)."""
        cache, folder = self.config.cache_config, self.folders.text
        with self.read_only.refusing_writes(self.folders.lock_base(folder)):
            return open_folder_cache(
                folder, cache.text_cache_type, "text", cache.persistent_cache, self.record_cache_dir
            )

    @contextmanager
    def writing(
        self,
        folder: Path,
        cache: TensorCache,
        keys: Iterable[str],
        reopen: Callable[[], TensorCache],
        may_rewrite: bool = False,
    ) -> Iterator[TensorCache]:
        """Hold ``folder``'s writer lock while ``cache`` gets the ``keys`` it lacks, so two runs sharing
        the folder never encode an entry twice. Nothing is held when every key is there (unless
        ``may_rewrite``, i.e. ``verify_content``), when the caches live in memory only, or on a rank other
        than 0 of a shared fill (rank 0 holds it for the launch). Yields the cache to fill, brought up to
        date under the lock (a disk store indexes new shards, a memory store is ``reopen``-ed)."""
        folder_locks = self._locks.get(self.folders.lock_base(folder))
        if self.share is not None and self.share.rank != 0 and shares_folder(cache.store):
            yield cache  # the shared fill tells this rank what is missing
            return
        if folder_locks is None or (not may_rewrite and all(key in cache for key in keys)):
            yield cache
            return
        with folder_locks.writing():
            if isinstance(cache.store, ShardedTensorStore):
                cache.store.refresh()
            else:
                cache = reopen()
            yield cache
