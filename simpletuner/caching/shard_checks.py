"""ShardVerifier: the integrity side of a :class:`~simpletuner.caching.store.ShardedTensorStore`.

Verifying entries against the CRC-32s in shard headers, reading entries with their checks, and
compacting a folder to the entries a config still needs. Composed over the store's public
interface (``locate``, ``shard_handle``, ``served_keys``, ``delete_shard`` ...), kept apart from the
read/write path of training.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Collection, Iterable, Mapping, Sequence

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

if TYPE_CHECKING:
    from simpletuner.caching.store import ShardedTensorStore

logger = logging.getLogger("simpletuner.caching.store")  # one logger for the whole store

QUARANTINE_SUFFIX = ".corrupt"
# Shards are verified on threads (zlib.crc32 and file reads release the GIL) where there are cores
# to spare; on a 2-core box a second thread measured no gain.
_VERIFY_WORKERS = min(8, (os.cpu_count() or 1) // 2)


class ShardVerifier:
    """The integrity checks of ``store``, through its public interface."""

    def __init__(self, store: ShardedTensorStore):
        self.store = store

    def verify(self, keys: Iterable[str] | None = None, desc: str | None = None) -> VerifyReport:
        """Read the given entries (default: all, plus those lost in unreadable shards) from disk
        and check their checksums. Keys the store never held are ignored (plain misses).

        Args:
            keys: the entries to check; None checks every entry.
            desc: a progress-bar label (shown on a terminal); None shows no bar.
        """
        store = self.store
        all_lost = store.lost_keys()
        if keys is None:
            wanted, problems = store.keys(), dict(all_lost)
        else:
            asked = list(dict.fromkeys(keys))
            wanted = [k for k in asked if k in store]
            problems = {k: all_lost[k] for k in asked if k in all_lost}
        by_shard: dict[Path, list[str]] = {}
        for key in wanted:
            by_shard.setdefault(store.locate(key)[0], []).append(key)
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
        return VerifyReport(num_ok, num_unverified, problems, store.unreadable_shards)

    def _verify_shard(self, shard: Path, keys: list[str]) -> tuple[int, int, dict[str, str]]:
        """``(num_ok, num_unverified, problems)`` of ``keys`` in ``shard``, read straight from the file."""
        try:
            header = read_header(shard)
        except (BadShard, OSError) as error:
            unreadable = f"shard {shard.name} cannot be read: {error}"
            return 0, 0, {key: unreadable for key in keys}
        is_checked = header.version != UNVERIFIED_VERSION
        num_ok = num_unverified = 0
        problems: dict[str, str] = {}
        with open(shard, "rb", buffering=0) as file:
            for key in keys:
                reason: str | None = None
                for name in self.store.locate(key)[1]:
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
    def _check_tensor(
        file: IO[bytes], header: ShardHeader, shard: Path, key: str, name: str, is_checked: bool
    ) -> str | None:
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
        store = self.store
        lost = store.lost_keys()
        problems: dict[str, str] = {}
        by_shard: dict[Path, list[str]] = {}
        for key in keys:
            if key not in store and key in lost:
                problems[key] = lost[key]
                continue
            by_shard.setdefault(store.locate(key)[0], []).append(key)
        entries: dict[str, dict[str, torch.Tensor]] = {}
        num_unverified = 0
        for shard, group in by_shard.items():
            try:
                handle = store.shard_handle(shard)
                metadata = handle.metadata() or {}
            except (SafetensorError, OSError) as error:
                problems.update({key: f"shard {shard.name} cannot be read: {error}" for key in group})
                continue
            is_checked = metadata.get("version", UNVERIFIED_VERSION) != UNVERIFIED_VERSION
            for key in group:
                try:
                    entry = {n: handle.get_tensor(f"{key}{KEY_SEPARATOR}{n}") for n in store.locate(key)[1]}
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

    def compact(self, keep: Collection[str]) -> CompactReport:
        """Rewrite the folder so that it holds only the entries in ``keep`` that pass their checksum.

        Superseded copies, entries not in ``keep`` (stale), corrupt entries, damaged shards
        and quarantined files are removed. A shard left with nothing to keep is deleted; one
        left with some is rewritten (new shard first, atomically, then the old one deleted).
        Entries of version-1 shards that are rewritten gain checksums over their current bytes.
        Not for a folder another process is training from.
        """
        store = self.store
        bytes_before = store.folder_bytes()
        num_removed = num_rewritten = num_deleted = 0
        for shard, shard_keys in store.shard_entries().items():
            wanted = [k for k in store.served_keys(shard) if k in keep]
            read = self.read_checked(wanted) if wanted else CheckedRead({}, {}, 0)
            if len(read.entries) == len(shard_keys):
                continue
            if read.entries:  # the source hashes travel along, so verify_content still trusts them
                store.put_many(read.entries, source_hashes=store.recorded_sources(read.entries))
                num_rewritten += 1
            num_removed += len(shard_keys) - len(read.entries)
            store.delete_shard(shard)
            num_deleted += 1
        for shard, keys in store.damaged_shards().items():
            store.delete_shard(shard)
            num_removed += len(keys)
            num_deleted += 1
        for path in store.quarantined_files():
            path.unlink(missing_ok=True)
            num_deleted += 1
        store.sync_folder()
        report = CompactReport(num_removed, num_rewritten, num_deleted, bytes_before, store.folder_bytes())
        logger.info("compacted %s: %s", store.root, report)
        return report
