"""What ``simpletuner cache`` finds in a cache folder, and how it says so.

:func:`inspect_cache` opens one folder read-only and checks every entry into a :class:`CacheSummary`
(compared with the keys a config needs, from :func:`simpletuner.caching.keys.cache_keys`);
:func:`check_sources` adds the ``--content`` check; the rest renders a summary as text or JSON.
The command itself (config loading, locks, removal) is :mod:`simpletuner.cli.cache`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

from simpletuner.caching.store import ShardedTensorStore
from simpletuner.caching.threads import map_threads
from simpletuner.caching.vae_cache import sample_source_hash, sample_source_name

#: The most keys, reasons or files a text report lists before "... and N more".
MAX_LISTED = 20
# File reads and blake2b release the GIL; as for checksums, a second thread gained nothing on 2 cores.
_HASH_WORKERS = min(8, (os.cpu_count() or 1) // 2)


@dataclass
class CacheSummary:
    """One cache folder as ``verify`` sees it. Counts of needed/missing/stale are None when the
    config's needed keys could not be computed (e.g. the dataset folder moved)."""

    name: str
    folder: str
    exists: bool
    num_shards: int = 0
    num_entries: int = 0
    num_bytes: int = 0
    num_ok: int = 0
    num_unverified: int = 0
    corrupt: dict[str, str] = field(default_factory=dict)
    unreadable_shards: dict[str, str] = field(default_factory=dict)
    num_superseded: int = 0
    quarantined_files: list[str] = field(default_factory=list)
    num_temp_files: int = 0
    num_needed: int | None = None
    num_present: int | None = None
    num_missing: int | None = None
    # of the missing: entries whose image does not decode (source name -> reason; a text entry only such
    # images need is named by its caption): training skips them, the next run will not encode them either
    unreadable: dict[str, str] = field(default_factory=dict)
    stale: list[str] | None = None
    # --content (the vae cache only; None when not asked or not applicable): needed entries whose
    # source was hashed again, those whose source changed (key -> source path), those without a
    # recorded hash, and how many changed ones --fix removed.
    num_content_checked: int | None = None
    content_changed: dict[str, str] = field(default_factory=dict)
    num_content_unhashed: int | None = None
    num_content_removed: int | None = None

    @property
    def has_corruption(self) -> bool:
        return bool(self.corrupt or self.unreadable_shards)

    @property
    def has_changed_content(self) -> bool:
        """Latents whose source changed and are still in the cache (not removed by --fix)."""
        return bool(self.content_changed) and not self.num_content_removed

    @property
    def num_removable(self) -> int:
        """What ``clear --stale-only`` would remove: entries, superseded copies and damaged files."""
        return (
            len(self.stale or ())
            + len(self.corrupt)
            + self.num_superseded
            + len(self.unreadable_shards)
            + len(self.quarantined_files)
        )


def check_sources(summary: CacheSummary, store: ShardedTensorStore, sources: dict[str, tuple[Any, Any]]) -> None:
    """Hash the source of every sound latent in ``store`` that ``sources`` (latent key -> (dataset,
    sample)) needs, compare it with the hash recorded at encode time, and fill ``summary``'s
    content fields. A source that cannot be read any more counts as changed."""
    keys = sorted(key for key in sources if key in store and key not in summary.corrupt)
    recorded = store.source_hashes(keys)
    to_check = [key for key in keys if recorded.get(key) is not None]

    def current(key: str) -> str | None:
        dataset, sample = sources[key]
        try:
            return sample_source_hash(dataset.backend, sample)
        except OSError:
            return None

    hashes = map_threads(current, to_check, _HASH_WORKERS, None, f"hashing {summary.name} sources")
    summary.num_content_checked = len(to_check)
    summary.num_content_unhashed = len(keys) - len(to_check)
    summary.content_changed = {
        key: sample_source_name(*sources[key]) for key, now in zip(to_check, hashes) if now != recorded[key]
    }


@contextlib.contextmanager
def _quiet_store_warnings() -> Iterator[None]:
    """The report lists unreadable shards itself; the store's own warnings would repeat them."""
    store_logger = logging.getLogger("simpletuner.caching.store")
    level = store_logger.level
    store_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        store_logger.setLevel(level)


def inspect_cache(name: str, folder: Path, needed: set[str] | None) -> tuple[CacheSummary, ShardedTensorStore | None]:
    """Open ``folder`` (if it exists; nothing is created) and check every entry in it."""
    summary = CacheSummary(name=name, folder=str(folder), exists=folder.is_dir())
    if not summary.exists:
        if needed is not None:
            summary.num_needed, summary.num_present, summary.num_missing, summary.stale = (
                len(needed),
                0,
                len(needed),
                [],
            )
        return summary, None
    with _quiet_store_warnings():
        store = ShardedTensorStore(folder)
    report = store.verify(desc=f"verifying {name} cache")
    summary.num_shards = len(store.shard_entries()) + len(store.unreadable_shards)
    summary.num_entries = len(store)
    summary.num_bytes = store.folder_bytes()
    summary.num_ok, summary.num_unverified = report.num_ok, report.num_unverified
    summary.corrupt = dict(report.problems)
    summary.unreadable_shards = {str(path): reason for path, reason in report.unreadable_shards.items()}
    summary.num_superseded = sum(len(keys) for keys in store.superseded().values())
    summary.quarantined_files = [str(p) for p in store.quarantined_files()]
    summary.num_temp_files = len(list(folder.glob(".tmp-shard-*")))
    if needed is not None:
        present = set(store.keys())
        summary.num_needed = len(needed)
        summary.num_present = len(needed & present)
        summary.num_missing = len(needed - present)
        summary.stale = sorted(present - needed)
    return summary, store


#: More missing latents than this are a cache still being filled: not decoded one by one to find unreadable images.
MAX_DECODED = 256


def note_unreadable(
    summaries: list[CacheSummary], stores: list[ShardedTensorStore | None], needed: list[set[str]], keys: Any
) -> None:
    """Tell the missing entries that will never be encoded from those the next run encodes: a latent whose
    image does not decode (training skips the file: ``max_bad_image_fraction``) and a text entry only such
    images caption. ``summaries`` / ``stores`` / ``needed``: the latent folders, then the text folder;
    ``keys``: the config's :class:`~simpletuner.caching.keys.CacheKeys`. Only folders that exist are
    looked at (a cache never filled says "encoded on the next run"), and at most :data:`MAX_DECODED` files."""
    from PIL import Image

    from simpletuner.caching.keys import DROPPED_CAPTION, text_id
    from simpletuner.data_backend import load_sample_pixels

    sources = keys.latent_sources()
    bad_samples: set[str] = set()
    for summary, store, wanted in zip(summaries[:-1], stores[:-1], needed[:-1]):
        missing = sorted(wanted - set(store.keys())) if store is not None else []
        if not missing or len(missing) > MAX_DECODED:
            continue
        for key in missing:
            dataset, sample = sources[key]
            try:
                load_sample_pixels(dataset, sample)
            except (OSError, ValueError, Image.DecompressionBombError) as exc:  # as the cache fill's loader
                reason = str(exc) if isinstance(exc, ValueError) else f"cannot decode image: {exc}"
                summary.unreadable[sample_source_name(dataset, sample)] = reason
                bad_samples.add(sample.key)
    text_store = stores[-1]
    if not bad_samples or text_store is None:
        return
    users: dict[Any, set[str]] = {}  # text id -> the samples that train with it
    for _, sample in keys.sources.values():
        for caption in [None, *sample.caption_lines[1:], DROPPED_CAPTION]:
            users.setdefault(text_id(sample, caption, keys.prompt_sees_source), set()).add(sample.key)
    present = set(text_store.keys())
    for item, key in keys.texts.items():
        if key not in present and key in needed[-1] and item in users and users[item] <= bad_samples:
            caption = item if isinstance(item, str) else item.caption
            summaries[-1].unreadable[repr(caption)] = "captions only images that do not decode"


def format_size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def print_summary(s: CacheSummary, out: TextIO) -> None:  # noqa: C901
    print(f"{s.name} cache: {s.folder}", file=out)
    if not s.exists:
        needed = f"; this config needs {s.num_needed} entries (encoded on the next run)" if s.num_needed else ""
        print(f"  not created yet{needed}", file=out)
        return
    print(f"  {s.num_shards} shard(s), {s.num_entries} entries, {format_size(s.num_bytes)}", file=out)
    if s.num_needed is not None:
        to_encode = (s.num_missing or 0) - len(s.unreadable)
        missing = f", {to_encode} missing (encoded on the next run)" if to_encode else ""
        skipped = f", {len(s.unreadable)} unreadable (skipped)" if s.unreadable else ""
        print(f"  needed by this config: {s.num_needed}, present: {s.num_present}{missing}{skipped}", file=out)
        for name, reason in list(s.unreadable.items())[:MAX_LISTED]:
            print(f"    unreadable {name}: {reason}", file=out)
        if len(s.unreadable) > MAX_LISTED:
            print(f"    ... and {len(s.unreadable) - MAX_LISTED} more", file=out)
    unverified = f", {s.num_unverified} unverified (written before checksums)" if s.num_unverified else ""
    print(f"  checksums: {s.num_ok} ok, {len(s.corrupt)} corrupt{unverified}", file=out)
    by_reason: dict[str, list[str]] = {}  # one line per reason: a lost shard gives many keys one reason
    for key, reason in s.corrupt.items():
        by_reason.setdefault(reason, []).append(key)
    for reason, keys in list(by_reason.items())[:MAX_LISTED]:
        which = keys[0] if len(keys) == 1 else f"{len(keys)} entries (e.g. {keys[0]})"
        print(f"    corrupt {which}: {reason}", file=out)
    if len(by_reason) > MAX_LISTED:
        print(f"    ... and {len(by_reason) - MAX_LISTED} more", file=out)
    for path, reason in s.unreadable_shards.items():
        print(f"  unreadable shard {Path(path).name}: {reason}", file=out)
    if s.stale:
        print(
            f"  stale: {len(s.stale)} entries not needed by this config (e.g. made by another VAE, resolution "
            "or caption; another config sharing this cache folder may still use them)",
            file=out,
        )
    if s.num_superseded:
        print(f"  superseded: {s.num_superseded} old copies of re-encoded entries", file=out)
    if s.quarantined_files:
        print(f"  {len(s.quarantined_files)} damaged shard(s) moved aside (*.corrupt)", file=out)
    if s.num_temp_files:
        print(f"  {s.num_temp_files} temp file(s) from interrupted writes", file=out)


def summary_json(summary: CacheSummary) -> dict[str, Any]:
    """The summary as plain data; the stale list is cut to a sample (it can be millions long)."""
    data = asdict(summary)
    stale = data.pop("stale")
    data["num_stale"] = None if stale is None else len(stale)
    data["stale_sample"] = None if stale is None else stale[:MAX_LISTED]
    data["has_corruption"] = summary.has_corruption
    data["has_changed_content"] = summary.has_changed_content
    return data


def print_content(s: CacheSummary, out: TextIO) -> None:
    """The ``--content`` lines of one cache (its sources, as hashed now)."""
    unhashed = (
        f", {s.num_content_unhashed} without a recorded hash (encoded before source hashes were stored: "
        "cannot be checked; a run with cache_config.verify_content re-encodes them)"
        if s.num_content_unhashed
        else ""
    )
    unchanged = (s.num_content_checked or 0) - len(s.content_changed)
    print(f"  sources: {unchanged} unchanged, {len(s.content_changed)} changed since encoded{unhashed}", file=out)
    for key, path in list(s.content_changed.items())[:MAX_LISTED]:
        print(f"    changed {path} (entry {key})", file=out)
    if len(s.content_changed) > MAX_LISTED:
        print(f"    ... and {len(s.content_changed) - MAX_LISTED} more", file=out)
    if s.num_content_removed:
        print(f"  removed {s.num_content_removed} entries whose source changed; the next run re-encodes them", file=out)


def print_removable(s: CacheSummary, out: TextIO) -> None:
    """``clear --stale-only --dry-run``: every entry and file of ``s`` the rewrite would remove, one a line."""
    for key in s.stale or ():
        print(f"    stale {key}", file=out)
    for key, reason in s.corrupt.items():
        print(f"    corrupt {key}: {reason}", file=out)
    for path in [*s.unreadable_shards, *s.quarantined_files]:
        print(f"    damaged {path}", file=out)
