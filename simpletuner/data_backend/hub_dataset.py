"""``type: huggingface`` datasets: the Parquet files of one split of a Hub dataset repo, fetched into the Hub
cache through huggingface_hub, then read in place by :class:`~simpletuner.data_backend.parquet_shards.ParquetBackend`.

:func:`fetch_split` resolves the revision to a commit, lists the repo (from the cache's tree listing where it has
one), picks the split's files by name (:mod:`.hub_splits`) and asks ``snapshot_download`` for exactly those, with
its progress bar. The settings are read from the environment at the call: ``HF_HUB_OFFLINE`` (the cache only),
``HF_ENDPOINT``, ``HF_HUB_CACHE`` / ``HF_HOME`` (where the cache is); the client reads ``HF_TOKEN`` itself.
Every way a repo cannot be had is one :class:`HubDatasetError` line naming the repo and the fix;
:func:`check_hub_datasets` gives them, and the files' missing columns, before a run writes anything.
documentation/DATA_SOURCES.md, "Hub datasets".
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simpletuner.configuration.cache_paths import is_trained
from simpletuner.data_backend.hub_splits import data_files, parquet_splits, split_parquet_files
from simpletuner.data_backend.parquet_shards import ParquetBackend, caption_column_read, check_file_columns
from simpletuner.exit_codes import first_line
from simpletuner.hub import HubError, hub_cache_dir, hub_endpoint, is_offline

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.configuration.dataset_sections import HuggingFaceDatasetConfig

logger = logging.getLogger(__name__)


class HubDatasetError(HubError):
    """A Hub dataset that cannot be had or read: the message names the repo and what to do."""


@dataclass(frozen=True)
class HubDatasetFiles:
    """One split of a Hub dataset in the local Hub cache: the repo, the revision asked for, the commit it
    resolved to, the snapshot folder and the split's Parquet files (POSIX paths relative to it, sorted)."""

    repo_id: str
    revision: str
    commit: str
    split: str
    folder: Path
    files: tuple[str, ...]

    def describe(self) -> str:
        """``org/name@main (commit 0123abcd4567), split train``."""
        return f"{self.repo_id}@{self.revision} (commit {self.commit[:12]}), split {self.split}"


def fetch_split(
    repo_id: str, split: str = "train", revision: str = "main", environ: Mapping[str, str] = os.environ
) -> HubDatasetFiles:
    """The Parquet files of ``split`` of the dataset repo ``repo_id`` at ``revision``, in the Hub cache: what it
    lacks is downloaded, unless offline. Logs the repo, the commit and the folder.

    Raises:
        HubDatasetError: the repo does not exist or is gated / private without a token, the revision does not
            exist, the Hub cannot be reached (or offline mode is on) and the cache lacks the files, or the
            split has no Parquet files.
    """
    from huggingface_hub import HfApi, snapshot_download

    where = _Where(repo_id, revision, split, environ)
    api = HfApi(endpoint=where.endpoint)
    with where.one_line():
        resolved = api.resolve_revision(
            repo_id, repo_type="dataset", revision=revision, cache_dir=where.cache, local_files_only=where.offline
        )
        commit = resolved.resolved
        listing, from_disk = _listing(api, where, commit)
        files = split_parquet_files(listing, split)
        if not files:
            raise HubDatasetError(where.no_files(listing, commit, from_disk))
        folder = snapshot_download(
            repo_id,
            repo_type="dataset",
            revision=resolved,
            cache_dir=where.cache,
            allow_patterns=[glob.escape(f) for f in files],
            local_files_only=where.offline,
            endpoint=where.endpoint,
        )
    fetched = HubDatasetFiles(repo_id, revision, commit, split, Path(folder), tuple(files))
    size = sum((fetched.folder / f).stat().st_size for f in files)
    logger.info(
        "Hub dataset %s: %d Parquet file(s), %.1f MB, in %s", fetched.describe(), len(files), size / 1e6, folder
    )
    return fetched


def _listing(api: Any, where: _Where, commit: str) -> tuple[list[str], bool]:
    """The repo's files at ``commit`` and whether they are only those on disk: the cache's tree listing, else
    (online) the Hub's, else (offline, a cache without a listing) the files of the snapshot folder."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        tree = get_cached_repo_tree(where.repo_id, repo_type="dataset", revision=commit, cache_dir=where.cache)
        return [f.path for f in tree], False
    except CachedRepoTreeNotFoundError:
        pass
    if not where.offline:
        return api.list_repo_files(where.repo_id, repo_type="dataset", revision=commit), False
    snapshot = where.snapshot(commit)
    if not snapshot.is_dir():
        raise HubDatasetError(where.not_cached())
    return [p.relative_to(snapshot).as_posix() for p in sorted(snapshot.rglob("*")) if p.is_file()], True


class _Where:
    """Where a fetch goes (endpoint, cache, offline, read from ``environ`` now) and its one-line messages."""

    def __init__(self, repo_id: str, revision: str, split: str, environ: Mapping[str, str]):
        self.repo_id, self.revision, self.split = repo_id, revision, split
        self.offline = is_offline(environ)
        self.endpoint = hub_endpoint(environ)
        self.cache = hub_cache_dir(environ)
        self.name = f"Hub dataset {repo_id!r}"

    def snapshot(self, commit: str) -> Path:
        from huggingface_hub.file_download import repo_folder_name

        return self.cache / repo_folder_name(repo_id=self.repo_id, repo_type="dataset") / "snapshots" / commit

    def _fill(self) -> str:
        """How a machine without network gets the files: fill a cache elsewhere and copy it here."""
        revision = f" --revision {self.revision}" if self.revision != "main" else ""
        return (
            f"fill a cache on a machine with network (`hf download {self.repo_id} --repo-type dataset{revision}`) "
            "and copy it here, or point HF_HUB_CACHE at the copy"
        )

    def not_cached(self) -> str:
        return (
            f"{self.name} (revision {self.revision}) is not in the Hub cache {self.cache} and HF_HUB_OFFLINE is set: "
            f"unset HF_HUB_OFFLINE to download it, or {self._fill()}"
        )

    def no_files(self, listing: list[str], commit: str, from_disk: bool) -> str:
        at = f"{self.name} at {self.revision} (commit {commit[:12]})"
        if from_disk:
            return (
                f"the Hub cache {self.cache} holds no Parquet files of split {self.split!r} of {at} and HF_HUB_OFFLINE "
                f"is set: {self._fill()}"
            )
        splits = parquet_splits(listing)
        if splits:
            listed = ", ".join(splits)
            return (
                f"{at} has no Parquet files for split {self.split!r}; its splits: {listed}; set `split` to one of them"
            )
        kinds = sorted({Path(p).suffix.lower() or Path(p).name for p in data_files(listing)})
        held = f"its data files are {', '.join(kinds[:6])}" if kinds else "it holds no data files"
        return (
            f"{at} has no Parquet files ({held}): set `revision: refs/convert/parquet` to read the Hub's Parquet "
            "conversion of it (where the Hub made one), or download it and use `type: local`"
        )

    @contextmanager
    def one_line(self) -> Iterator[None]:
        """huggingface_hub's errors inside, as one :class:`HubDatasetError` line naming the repo and the fix."""
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            IncompleteSnapshotError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
            RevisionResolutionError,
        )

        hub = f"the Hub at {self.endpoint}"
        try:
            yield
        except GatedRepoError:
            raise HubDatasetError(
                f"{self.name} is gated on {hub}: accept its conditions on the dataset's page "
                f"({self.endpoint}/datasets/{self.repo_id}), then log in on this machine (`hf auth login`, or set "
                "HF_TOKEN to a token of that account)"
            ) from None
        except RepositoryNotFoundError:
            raise HubDatasetError(
                f"{self.name}: no such dataset repo on {hub}, or it is private and {self._token_state()}: check "
                "`dataset_name` (`org/name`, as on the dataset's page), or log in (`hf auth login`, or set HF_TOKEN)"
            ) from None
        except RevisionNotFoundError:
            raise HubDatasetError(
                f"{self.name}: revision {self.revision!r} does not exist on {hub}: set `revision` to a branch, tag or "
                "commit of the repo, or leave it out for `main`"
            ) from None
        except IncompleteSnapshotError:
            raise HubDatasetError(
                f"the Hub cache {self.cache} holds only part of split {self.split!r} of {self.name} (revision "
                f"{self.revision}) and {'HF_HUB_OFFLINE is set' if self.offline else f'{hub} cannot be reached'}: "
                f"{self._fill()}"
            ) from None
        except (RevisionResolutionError, LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
            # the client's own offline switch (HF_HUB_OFFLINE when it was imported) stops requests too
            if self.offline or isinstance(exc, OfflineModeIsEnabled) or isinstance(exc.__cause__, OfflineModeIsEnabled):
                raise HubDatasetError(self.not_cached()) from None
            raise HubDatasetError(
                f"{self.name}: {hub} cannot be reached and the Hub cache {self.cache} does not hold it: check the "
                f"network (and HF_ENDPOINT), or {self._fill()}"
            ) from None
        except (HfHubHTTPError, OSError) as exc:
            raise HubDatasetError(
                f"{self.name}: downloading from {hub} failed ({first_line(exc)}); run again (what was fetched stays "
                f"in the cache {self.cache})"
            ) from None

    @staticmethod
    def _token_state() -> str:
        from huggingface_hub import get_token

        return "the token in use has no access to it" if get_token() else "no token is set"


def check_columns_of(fetched: HubDatasetFiles, dataset_cfg: HuggingFaceDatasetConfig) -> None:
    """Refuse the split's files when one lacks a column the entry names (the footer of each is read).

    Raises:
        HubDatasetError: naming the repo, the file, the key and the columns the file has.
    """
    for name in fetched.files:
        where = f"Hub dataset {fetched.describe()}: {name}"
        try:
            check_file_columns(
                fetched.folder / name,
                where,
                dataset_cfg.image_column,
                caption_column_read(dataset_cfg),
                dataset_cfg.filename_column,
            )
        except ValueError as exc:
            raise HubDatasetError(str(exc)) from None


def fetch_dataset(dataset_cfg: HuggingFaceDatasetConfig, environ: Mapping[str, str] = os.environ) -> HubDatasetFiles:
    """:func:`fetch_split` for a ``huggingface`` entry, its columns checked (:func:`check_columns_of`)."""
    fetched = fetch_split(dataset_cfg.dataset_name, dataset_cfg.split, dataset_cfg.revision, environ)
    check_columns_of(fetched, dataset_cfg)
    return fetched


def check_hub_datasets(config: TrainingConfig, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Every ``type: huggingface`` dataset the run trains, fetched into the Hub cache and its columns checked,
    before the run writes anything: one line per problem, ``datasets[i] (id): ...``; empty when all is well."""
    problems = []
    for index, dataset_cfg in enumerate(config.datasets or []):
        if dataset_cfg.type != "huggingface" or not is_trained(dataset_cfg):
            continue
        try:
            fetch_dataset(dataset_cfg, environ)
        except HubDatasetError as exc:
            problems.append(f"datasets[{index}] ({dataset_cfg.id}): {exc}")
    return problems


class HubParquetBackend(ParquetBackend):
    """A :class:`ParquetBackend` over the split's files in the Hub cache; its messages name the repo and the
    file's path in it (virtual paths are ``<path in the repo>/<row name>``)."""

    def __init__(self, fetched: HubDatasetFiles, id: str, **columns: Any):
        self.fetched = fetched
        super().__init__(fetched.folder, id, files=fetched.files, **columns)

    def _where(self, index: int) -> str:
        return f"dataset {self.id!r}: Hub dataset {self.fetched.describe()}: {self.shards[index].path}"


def build_huggingface_backend(dataset_cfg: HuggingFaceDatasetConfig, config: TrainingConfig) -> HubParquetBackend:
    """The ``huggingface`` entry of ``data_backend.factory.BUILDERS``: the split fetched (or found in the cache),
    read as a Parquet dataset.

    Raises:
        HubDatasetError: as :func:`fetch_dataset`.
    """
    fetched = fetch_dataset(dataset_cfg)
    return HubParquetBackend(
        fetched,
        dataset_cfg.id,
        image_column=dataset_cfg.image_column,
        caption_column=caption_column_read(dataset_cfg),
        filename_column=dataset_cfg.filename_column,
    )
