"""ShardChecks: the integrity side of :class:`~simpletuner.caching.store.ShardedTensorStore`.

Verifying entries against the CRC-32s in shard headers, reading entries with their checks,
and the maintenance built on it (dropping keys, moving unreadable shards aside, compacting to
the entries a config still needs). A mixin over the store's index and handles, kept apart from
the read/write path so the training side stays small.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping, Sequence

import orjson
import torch
from safetensors import SafetensorError
from tqdm import tqdm

from simpletuner.caching.integrity import (
    CHECKSUM_PREFIX,
    KEY_SEPARATOR,
    UNVERIFIED_VERSION,
    BadShard,
    CheckedRead,
    CompactReport,
    ShardHeader,
    VerifyReport,
    checksum,
    read_header,
    tensor_checksum,
)

logger = logging.getLogger("simpletuner.caching.store")  # one logger for the whole store

QUARANTINE_SUFFIX = ".corrupt"
MARKER_SUFFIX = ".marker.json"
_MARKER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
# Shards are verified on threads (zlib.crc32 and file reads release the GIL) where there are cores
# to spare; on a 2-core box a second thread measured no gain.
_VERIFY_WORKERS = min(8, (os.cpu_count() or 1) // 2)


def check_marker_name(name: str) -> str:
    """``name`` when it is a plain file name part (letters, digits, ``._-``); else ValueError."""
    if not isinstance(name, str) or not _MARKER_NAME.match(name):
        raise ValueError(
            f"marker name {name!r} must be letters, digits, '.', '_' or '-' (not starting with '.' or '-')"
        )
    return name


class ShardChecks:
    """Integrity methods of ShardedTensorStore (uses its index, handles and root)."""

    def verify(self, keys: Iterable[str] | None = None, desc: str | None = None) -> VerifyReport:
        """Read the given entries (default: all, plus those lost in unreadable shards) from disk
        and check their checksums. Keys the store never held are ignored (plain misses).

        Args:
            keys: the entries to check; None checks every entry.
            desc: a progress-bar label (shown on a terminal); None shows no bar.
        """
        all_lost = self.lost_keys()
        if keys is None:
            wanted, problems = list(self._index), dict(all_lost)
        else:
            asked = list(dict.fromkeys(keys))
            wanted = [k for k in asked if k in self._index]
            problems = {k: all_lost[k] for k in asked if k in all_lost}
        by_shard: dict[Path, list[str]] = {}
        for key in wanted:
            by_shard.setdefault(self._index[key][0], []).append(key)
        num_ok = num_unverified = 0
        progress = tqdm(total=len(wanted), desc=desc, unit="entry", disable=None if desc else True)
        workers = min(_VERIFY_WORKERS, len(by_shard))
        try:
            if workers > 1:
                with ThreadPoolExecutor(workers, thread_name_prefix="cache-verify") as pool:
                    results = pool.map(lambda item: self._verify_shard(*item), by_shard.items())
                    for (ok, unverified, bad), group in zip(results, by_shard.values()):
                        num_ok, num_unverified = num_ok + ok, num_unverified + unverified
                        problems.update(bad)
                        progress.update(len(group))
            else:
                for shard, group in by_shard.items():
                    ok, unverified, bad = self._verify_shard(shard, group)
                    num_ok, num_unverified = num_ok + ok, num_unverified + unverified
                    problems.update(bad)
                    progress.update(len(group))
        finally:
            progress.close()
        return VerifyReport(num_ok, num_unverified, problems, self.unreadable_shards)

    def _verify_shard(self, shard: Path, keys: list[str]) -> tuple[int, int, dict[str, str]]:
        """``(num_ok, num_unverified, problems)`` of ``keys`` in ``shard``, read straight from the file."""
        try:
            header = read_header(shard)
        except (BadShard, OSError) as error:
            reason = f"shard {shard.name} cannot be read: {error}"
            return 0, 0, {key: reason for key in keys}
        is_checked = header.version != UNVERIFIED_VERSION
        num_ok = num_unverified = 0
        problems: dict[str, str] = {}
        with open(shard, "rb", buffering=0) as file:
            for key in keys:
                reason = None
                for name in self._index[key][1]:
                    reason = self._check_tensor(file, header, shard, key, name, is_checked)
                    if reason:
                        break
                if reason:
                    problems[key] = reason
                elif is_checked:
                    num_ok += 1
                else:
                    num_unverified += 1
        return num_ok, num_unverified, problems

    @staticmethod
    def _check_tensor(file, header: ShardHeader, shard: Path, key: str, name: str, is_checked: bool) -> str | None:
        tensor_name = f"{key}{KEY_SEPARATOR}{name}"
        info = header.tensors.get(tensor_name)
        if info is None:
            return f"tensor {name!r} is missing from shard {shard.name}"
        if not is_checked:
            return None
        expected = header.metadata.get(CHECKSUM_PREFIX + tensor_name)
        if expected is None:
            return f"no checksum recorded for tensor {name!r} in shard {shard.name}"
        begin, end = info["data_offsets"]
        file.seek(header.data_start + begin)
        data = file.read(end - begin)
        if len(data) != end - begin:
            return f"shard {shard.name} is truncated"
        actual = checksum(info["dtype"], info["shape"], data)
        if actual != expected:
            return f"checksum mismatch in tensor {name!r} of shard {shard.name} (recorded {expected}, read {actual})"
        return None

    def read_checked(self, keys: Sequence[str]) -> CheckedRead:
        """Read ``keys`` and check each tensor against its checksum (for loading into memory).

        Entries that fail, or that were lost in an unreadable shard, are left out and listed in
        ``problems``; entries of version-1 shards are returned and counted as unverified.

        Raises:
            KeyError: a key is neither stored nor lost in an unreadable shard.
        """
        lost = self.lost_keys()
        problems: dict[str, str] = {}
        by_shard: dict[Path, list[str]] = {}
        for key in keys:
            if key not in self._index and key in lost:
                problems[key] = lost[key]
                continue
            by_shard.setdefault(self._locate(key)[0], []).append(key)
        entries: dict[str, dict[str, torch.Tensor]] = {}
        num_unverified = 0
        for shard, group in by_shard.items():
            try:
                handle = self._handle(shard)
                metadata = handle.metadata() or {}
            except (SafetensorError, OSError) as error:
                problems.update({key: f"shard {shard.name} cannot be read: {error}" for key in group})
                continue
            is_checked = metadata.get("version", UNVERIFIED_VERSION) != UNVERIFIED_VERSION
            for key in group:
                try:
                    entry = {n: handle.get_tensor(f"{key}{KEY_SEPARATOR}{n}") for n in self._index[key][1]}
                except SafetensorError as error:
                    problems[key] = f"shard {shard.name} cannot be read: {error}"
                    continue
                reason = self._check_entry(metadata, shard, key, entry) if is_checked else None
                if reason:
                    problems[key] = reason
                    continue
                num_unverified += not is_checked
                entries[key] = entry
        return CheckedRead(entries, problems, num_unverified)

    @staticmethod
    def _check_entry(
        metadata: Mapping[str, str], shard: Path, key: str, entry: Mapping[str, torch.Tensor]
    ) -> str | None:
        for name, tensor in entry.items():
            expected = metadata.get(f"{CHECKSUM_PREFIX}{key}{KEY_SEPARATOR}{name}")
            if expected is None:
                return f"no checksum recorded for tensor {name!r} in shard {shard.name}"
            actual = tensor_checksum(tensor)
            if actual != expected:
                return (
                    f"checksum mismatch in tensor {name!r} of shard {shard.name} (recorded {expected}, read {actual})"
                )
        return None

    def discard(self, keys: Iterable[str]) -> None:
        """Stop serving ``keys`` (in this process; nothing on disk changes), e.g. corrupt
        entries about to be re-encoded: they become misses, and a later write wins."""
        for key in keys:
            self._index.pop(key, None)

    def quarantine_unreadable(self) -> list[Path]:
        """Rename damaged shards (truncated, corrupt header) to ``<name>.corrupt`` so they stop
        being scanned; returns the new paths. Foreign or newer-format shards are left alone."""
        moved = []
        for shard, info in list(self._unreadable.items()):
            if not info.is_corrupt:
                continue
            target = shard.with_name(shard.name + QUARANTINE_SUFFIX)
            try:
                os.replace(shard, target)
            except FileNotFoundError:
                pass  # already gone
            except OSError as error:
                logger.warning("cannot move unreadable cache shard %s aside: %s", shard, error)
                continue
            else:
                moved.append(target)
                logger.warning("moved unreadable cache shard %s aside to %s (%s)", shard.name, target.name, info.reason)
            del self._unreadable[shard]
            self._indexed_shards.discard(shard)
        return moved

    def compact(self, keep: Collection[str]) -> CompactReport:
        """Rewrite the folder so that it holds only the entries in ``keep`` that pass their checksum.

        Superseded copies, entries not in ``keep`` (stale), corrupt entries, damaged shards
        and quarantined files are removed. A shard left with nothing to keep is deleted; one
        left with some is rewritten (new shard first, atomically, then the old one deleted).
        Entries of version-1 shards that are rewritten gain checksums over their current bytes.
        Not for a folder another process is training from.
        """
        bytes_before = self.folder_bytes()
        num_removed = num_rewritten = num_deleted = 0
        for shard, shard_keys in list(self._shard_keys.items()):
            live = [k for k in shard_keys if self._index.get(k, (None,))[0] == shard]
            wanted = [k for k in live if k in keep]
            read = self.read_checked(wanted) if wanted else CheckedRead({}, {}, 0)
            if len(read.entries) == len(shard_keys):
                continue
            if read.entries:  # the source hashes travel along, so verify_content still trusts them
                self.put_many(read.entries, source_hashes=self._recorded_sources(read.entries))
                num_rewritten += 1
            num_removed += len(shard_keys) - len(read.entries)
            self._forget_shard(shard)
            shard.unlink(missing_ok=True)
            num_deleted += 1
        for shard, info in list(self._unreadable.items()):
            if info.is_corrupt:
                shard.unlink(missing_ok=True)
                del self._unreadable[shard]
                self._indexed_shards.discard(shard)
                num_removed += len(info.keys)
                num_deleted += 1
        for path in self.quarantined_files():
            path.unlink(missing_ok=True)
            num_deleted += 1
        self._fsync_root()
        report = CompactReport(num_removed, num_rewritten, num_deleted, bytes_before, self.folder_bytes())
        logger.info("compacted %s: %s", self.root, report)
        return report

    # --- removal and markers (e.g. the per-epoch augmented latents) ---
    def remove(self, keys: Iterable[str]) -> int:
        """Delete the entries of ``keys`` from disk (unlike :meth:`discard`); returns how many were held.

        A shard holding nothing else is deleted; one that also holds entries still served is
        rewritten without them first (new shard atomically, then the old one deleted), so a
        crash leaves every kept entry readable. Not for a folder another process reads from.
        """
        doomed = set(keys)
        num_removed = sum(key in self._index for key in doomed)
        for shard, shard_keys in list(self._shard_keys.items()):
            if not doomed.intersection(shard_keys):
                continue
            kept = [k for k in shard_keys if k not in doomed and self._index.get(k, (None,))[0] == shard]
            if kept:
                self.put_many(dict(zip(kept, self.get_many(kept))), source_hashes=self._recorded_sources(kept))
            self._forget_shard(shard)
            shard.unlink(missing_ok=True)
        self.discard(doomed)  # keys held only by unreadable shards
        self._fsync_root()
        return num_removed

    def _recorded_sources(self, keys: Iterable[str]) -> dict[str, str]:
        """The source hashes recorded for ``keys`` (those that have one), to rewrite them with."""
        return {key: value for key, value in self.source_hashes(list(keys)).items() if value is not None}

    def _marker_path(self, name: str) -> Path:
        return self.root / f"{check_marker_name(name)}{MARKER_SUFFIX}"

    def write_marker(self, name: str, content: Mapping[str, Any]) -> None:
        """Record ``content`` (JSON-able) under ``name`` in the store folder, atomically (temp file,
        fsync, rename), e.g. "every entry of version 3 is written"."""
        path = self._marker_path(name)
        temp = path.with_name(f".tmp-{path.name}")
        with open(temp, "wb") as file:
            file.write(orjson.dumps(dict(content), option=orjson.OPT_SORT_KEYS))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
        self._fsync_root()

    def read_marker(self, name: str) -> dict[str, Any] | None:
        """The content of marker ``name``, or None when there is none (or it cannot be parsed)."""
        try:
            content = orjson.loads(self._marker_path(name).read_bytes())
        except FileNotFoundError:
            return None
        except orjson.JSONDecodeError as error:
            logger.warning("ignoring unreadable marker %s: %s", self._marker_path(name), error)
            return None
        return content if isinstance(content, dict) else None

    def marker_names(self) -> list[str]:
        """Names of the markers in the folder."""
        return sorted(p.name[: -len(MARKER_SUFFIX)] for p in self.root.glob(f"*{MARKER_SUFFIX}"))

    def remove_marker(self, name: str) -> None:
        """Delete marker ``name`` (nothing happens when there is none)."""
        self._marker_path(name).unlink(missing_ok=True)
