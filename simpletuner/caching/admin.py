"""``simpletuner cache verify|clear --config cfg.json``: list, check and remove a config's caches.

The caches of a config live in ``<cache_dir>/<model_family>/{vae,text}``. ``verify`` opens
each one read-only, checks every entry against the checksum recorded when it was written,
and compares what is stored with what the config needs now (the dataset is scanned and the
keys built the way training builds them), so after a VAE change the old latents show up as
stale. ``verify --content`` also reads the source file of every needed latent and compares a
hash of its bytes with the one recorded when the latent was encoded (a file edited in place
with its size and mtime kept has the same key); ``--fix`` removes the changed ones so the next
run re-encodes them. ``clear`` removes both caches, or with ``--stale-only`` rewrites them to
hold only the sound entries the config needs.

Exit status: 0 all is well (missing and stale entries are not errors; changed sources that
``--fix`` removed neither), 1 corruption found, latents whose source changed (``--content``
without ``--fix``), or a removal declined, 2 a usage or config error (including ``clear``
without ``--yes`` when stdin is not a terminal, and ``--content`` when the dataset cannot be
scanned; ``clear`` while a training run uses the cache, unless ``--wait``: see :mod:`simpletuner.locks`).
``verify`` takes no lock: it only reads.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, TextIO

import orjson

from simpletuner.caching.store import ShardedTensorStore
from simpletuner.caching.tensor_cache import map_threads
from simpletuner.caching.text_cache import caption_text_key
from simpletuner.caching.vae_cache import sample_latent_key, sample_source_hash, sample_source_name
from simpletuner.locks import CacheLocks

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)

CACHE_NAMES = ("vae", "text")
_MAX_LISTED = 20
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


def cache_base(config: "TrainingConfig") -> Path:
    """``<cache_dir>/<model_family>``, as training opens it (relative to the working directory)."""
    from simpletuner.models import get_model_spec

    return Path(config.cache_config.cache_dir).expanduser() / get_model_spec(config).family


def needed_keys(config: "TrainingConfig") -> dict[str, set[str]]:
    """``{"vae": latent keys, "text": text keys}`` the config needs now, built as
    :func:`simpletuner.training.batches.prepare_caches` builds them.

    Datasets are scanned from their folders without staging (an ``in_memory`` dataset's keys
    use the same file identities as a local one). Captions of images that turn out to be
    undecodable at encode time are still counted, so such entries show as missing.

    Raises:
        ValueError: the config has no datasets, a dataset scan fails, or an encoder folder is unusable.
        OSError: a folder cannot be read.
    """
    return _scan_needed(config)[0]


def _scan_needed(config: "TrainingConfig") -> tuple[dict[str, set[str]], dict[str, tuple[Any, Any]]]:
    """:func:`needed_keys`, and ``{latent key: (dataset, sample)}`` to find each latent's source."""
    from simpletuner.data_backend import RegisteredDataset, build_local_backend, build_metadata
    from simpletuner.data_backend.augment import static_augmentation_key
    from simpletuner.models import get_model_spec
    from simpletuner.training.performance import PRECISION_DTYPES, resolve_mixed_precision

    if not config.datasets:
        raise ValueError("the config has no `datasets`")
    spec = get_model_spec(config)
    image_identity = spec.image_encoder_identity()
    text_identity = spec.text_encoder_identity()
    text_dtype = PRECISION_DTYPES[resolve_mixed_precision(config.mixed_precision)]
    augment = static_augmentation_key(config)  # the static cache holds augmented latents under their own keys
    latent_sources: dict[str, tuple[Any, Any]] = {}
    captions: set[str] = set()
    for dataset_cfg in config.datasets:
        backend = build_local_backend(dataset_cfg, config)
        metadata = build_metadata(backend, dataset_cfg, config, seed=config.seed)
        dataset = RegisteredDataset(dataset_cfg.id, dataset_cfg, backend, metadata)
        for sample in metadata.samples:
            key = sample_latent_key(dataset, sample, image_identity, config.resolution, augment=augment)
            latent_sources.setdefault(key, (dataset, sample))
            captions.add(sample.caption)
    text_keys = {caption_text_key(c, text_identity, text_dtype) for c in captions}
    return {"vae": set(latent_sources), "text": text_keys}, latent_sources


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


def _size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _print_summary(s: CacheSummary, out: TextIO) -> None:
    print(f"{s.name} cache: {s.folder}", file=out)
    if not s.exists:
        needed = f"; this config needs {s.num_needed} entries (encoded on the next run)" if s.num_needed else ""
        print(f"  not created yet{needed}", file=out)
        return
    print(f"  {s.num_shards} shard(s), {s.num_entries} entries, {_size(s.num_bytes)}", file=out)
    if s.num_needed is not None:
        missing = f", {s.num_missing} missing (encoded on the next run)" if s.num_missing else ""
        print(f"  needed by this config: {s.num_needed}, present: {s.num_present}{missing}", file=out)
    unverified = f", {s.num_unverified} unverified (written before checksums)" if s.num_unverified else ""
    print(f"  checksums: {s.num_ok} ok, {len(s.corrupt)} corrupt{unverified}", file=out)
    by_reason: dict[str, list[str]] = {}  # one line per reason: a lost shard gives many keys one reason
    for key, reason in s.corrupt.items():
        by_reason.setdefault(reason, []).append(key)
    for reason, keys in list(by_reason.items())[:_MAX_LISTED]:
        which = keys[0] if len(keys) == 1 else f"{len(keys)} entries (e.g. {keys[0]})"
        print(f"    corrupt {which}: {reason}", file=out)
    if len(by_reason) > _MAX_LISTED:
        print(f"    ... and {len(by_reason) - _MAX_LISTED} more", file=out)
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


def _load(args: argparse.Namespace):
    from simpletuner.configuration import load_config

    return load_config(args.config, args.overrides, check_files=False).config


@dataclass
class _Inspection:
    summaries: list[CacheSummary]
    stores: list[ShardedTensorStore | None]
    needed: dict[str, set[str]] | None
    why_not_needed: str | None  # why the needed keys could not be computed


def _inspect_all(config: "TrainingConfig", content: bool = False) -> _Inspection:
    """Inspect every cache of ``config``; with ``content`` also hash the latents' sources."""
    base = cache_base(config)
    sources: dict[str, tuple[Any, Any]] = {}
    try:
        needed, sources = _scan_needed(config)
        why_not = None
    except (ValueError, OSError) as error:
        needed, why_not = None, str(error)
    pairs = [inspect_cache(name, base / name, needed[name] if needed else None) for name in CACHE_NAMES]
    if content and needed is not None:
        summary, store = pairs[CACHE_NAMES.index("vae")]
        if store is not None:
            check_sources(summary, store, sources)
        else:
            summary.num_content_checked = summary.num_content_unhashed = 0
    return _Inspection([p[0] for p in pairs], [p[1] for p in pairs], needed, why_not)


def _as_json(summary: CacheSummary) -> dict[str, Any]:
    """The summary as plain data; the stale list is cut to a sample (it can be millions long)."""
    data = asdict(summary)
    stale = data.pop("stale")
    data["num_stale"] = None if stale is None else len(stale)
    data["stale_sample"] = None if stale is None else stale[:_MAX_LISTED]
    data["has_corruption"] = summary.has_corruption
    data["has_changed_content"] = summary.has_changed_content
    return data


def _print_content(s: CacheSummary, out: TextIO) -> None:
    """The ``--content`` lines of one cache (its sources, as hashed now)."""
    unhashed = (
        f", {s.num_content_unhashed} without a recorded hash (encoded before source hashes were stored: "
        "cannot be checked; a run with cache_config.verify_content re-encodes them)"
        if s.num_content_unhashed
        else ""
    )
    unchanged = (s.num_content_checked or 0) - len(s.content_changed)
    print(f"  sources: {unchanged} unchanged, {len(s.content_changed)} changed since encoded{unhashed}", file=out)
    for key, path in list(s.content_changed.items())[:_MAX_LISTED]:
        print(f"    changed {path} (entry {key})", file=out)
    if len(s.content_changed) > _MAX_LISTED:
        print(f"    ... and {len(s.content_changed) - _MAX_LISTED} more", file=out)
    if s.num_content_removed:
        print(f"  removed {s.num_content_removed} entries whose source changed; the next run re-encodes them", file=out)


def _fix_changed(config: "TrainingConfig", inspection: _Inspection, wait: bool) -> None:
    """``--fix``: remove the latents whose source changed, so the next run re-encodes them. The cache
    is held as ``cache clear`` holds it: a run reading a shard while it is rewritten would fail.

    Raises:
        FolderLocked (a ValueError): a run uses the cache and ``wait`` is False.
    """
    from simpletuner.locks import CacheLocks

    index = CACHE_NAMES.index("vae")
    summary, store = inspection.summaries[index], inspection.stores[index]
    if store is None or not summary.content_changed:
        return
    with CacheLocks(cache_base(config)).clearing(wait=wait, say=lambda message: print(message, file=sys.stderr)):
        removed = summary.num_content_removed = store.remove(list(summary.content_changed))
    summary.num_entries -= removed  # the counts describe the cache as the command leaves it
    summary.num_ok -= removed
    if summary.num_present is not None and summary.num_missing is not None:
        summary.num_present, summary.num_missing = summary.num_present - removed, summary.num_missing + removed


def cmd_verify(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """List and check the caches of ``args.config``; 1 when an entry or shard is damaged, or (with
    ``--content``) a latent's source changed and ``--fix`` did not remove it."""
    out = out or sys.stdout
    content, fix = getattr(args, "content", False), getattr(args, "fix", False)
    if fix and not content:
        print(
            "error: --fix goes with --content (it removes latents whose source file changed). Corrupt entries are "
            "re-encoded by the next run, or removed by `simpletuner cache clear --stale-only`",
            file=sys.stderr,
        )
        return 2
    config = _load(args)
    inspection = _inspect_all(config, content=content)
    summaries, why_not = inspection.summaries, inspection.why_not_needed
    content_error = why_not if content and inspection.needed is None else None
    if fix:
        _fix_changed(config, inspection, getattr(args, "wait", False))
    is_corrupt = any(s.has_corruption for s in summaries)
    num_changed = sum(len(s.content_changed) for s in summaries if s.has_changed_content)
    status = 1 if is_corrupt else 2 if content_error else 1 if num_changed else 0
    if args.json:
        payload: dict[str, Any] = {
            "config": str(args.config),
            "is_clean": not is_corrupt and not num_changed,
            "needed_keys_error": why_not,
            "content_checked": content and not content_error,
            "caches": [_as_json(s) for s in summaries],
        }
        out.write(orjson.dumps(payload, option=orjson.OPT_INDENT_2).decode() + "\n")
        return status
    if why_not:
        print(f"note: cannot tell which entries this config needs ({why_not}); checksums are still checked", file=out)
    for summary in summaries:
        _print_summary(summary, out)
        if summary.num_content_checked is not None:
            _print_content(summary, out)
    if content_error:
        print(f"error: --content cannot find the source files of the latents: {content_error}", file=sys.stderr)
    if num_changed:
        print(
            f"{num_changed} cached latent(s) no longer match their source file (edited in place with its size and "
            f"modification time kept). Remove them with `simpletuner cache verify --config {args.config} --content "
            "--fix` (the next run re-encodes them), or train with `cache_config.verify_content: true`.",
            file=out,
        )
    if is_corrupt:
        print(
            f"corruption found. Damaged entries are re-encoded on the next training run; or remove them now with "
            f"`simpletuner cache clear --config {args.config} --stale-only` (or everything without --stale-only).",
            file=out,
        )
    if status:
        return status
    if any(s.stale or s.num_superseded for s in summaries):
        print(
            f"all entries are sound. `simpletuner cache clear --config {args.config} --stale-only` frees the stale ones.",
            file=out,
        )
    else:
        print("all entries are sound.", file=out)
    return 0


def _confirm(question: str, assume_yes: bool, stdin: TextIO, out: TextIO) -> int | None:
    """None to go ahead, else the exit status: 2 without --yes off a terminal, 1 when declined."""
    if assume_yes:
        return None
    if not stdin.isatty():
        print("refusing to remove anything without --yes (stdin is not a terminal)", file=sys.stderr)
        return 2
    print(f"{question} [y/N] ", end="", file=out, flush=True)
    answer = stdin.readline().strip().lower()
    if answer in ("y", "yes"):
        return None
    print("nothing removed", file=out)
    return 1


def cmd_clear(args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    """Remove the caches of ``args.config`` (or, with --stale-only, what it does not need), holding
    the cache folder exclusively: while a run uses it this refuses (exit 2, naming the runs), or
    with ``--wait`` waits for them to end."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    config = _load(args)
    base = cache_base(config)
    locks = CacheLocks(base)
    held = (
        locks.clearing(wait=args.wait, say=lambda line: print(line, file=out, flush=True))
        if base.is_dir()
        else contextlib.nullcontext()
    )  # nothing there to protect; locking would create the folder
    with held:
        if args.stale_only:
            return _clear_stale(config, args, stdin, out)
        return _clear_all(locks, args, stdin, out)


def _clear_all(locks: CacheLocks, args: argparse.Namespace, stdin: TextIO, out: TextIO) -> int:
    base = locks.base
    from simpletuner.training.reencode import EPOCH_CACHE_NAME

    folders = [base / name for name in (*CACHE_NAMES, EPOCH_CACHE_NAME) if (base / name).exists()]
    if not folders:
        print(f"nothing to remove: no caches under {base}", file=out)
        return 0
    print("will remove:", file=out)
    for folder in folders:
        files = [p for p in folder.rglob("*") if p.is_file()]
        print(f"  {folder}  ({len(files)} files, {_size(sum(p.stat().st_size for p in files))})", file=out)
    status = _confirm("remove these folders?", args.yes, stdin, out)
    if status is not None:
        return status
    for folder in folders:
        shutil.rmtree(folder)
    locks.remove_if_empty()  # the folder goes too when only the locks were left in it
    print(f"removed {len(folders)} cache folder(s)", file=out)
    return 0


def _clear_stale(config: "TrainingConfig", args: argparse.Namespace, stdin: TextIO, out: TextIO) -> int:
    inspection = _inspect_all(config)
    needed = inspection.needed
    if needed is None:
        print(
            f"error: cannot tell which entries this config needs ({inspection.why_not_needed}); --stale-only needs that. "
            "Fix the config, or remove everything without --stale-only",
            file=sys.stderr,
        )
        return 2
    plan = [
        (s, store) for s, store in zip(inspection.summaries, inspection.stores) if store is not None and s.num_removable
    ]
    if not plan:
        print("nothing to remove: every stored entry is sound and needed by this config", file=out)
        return 0
    print("will remove:", file=out)
    for s, _ in plan:
        parts = [f"{len(s.stale or ())} stale", f"{len(s.corrupt)} corrupt", f"{s.num_superseded} superseded"]
        damaged = len(s.unreadable_shards) + len(s.quarantined_files)
        print(f"  {s.name} cache {s.folder}: {', '.join(parts)} entries, {damaged} damaged file(s)", file=out)
        if s.stale:
            print(f"    stale e.g.: {', '.join(s.stale[:3])}", file=out)
    status = _confirm("rewrite these caches?", args.yes, stdin, out)
    if status is not None:
        return status
    for s, store in plan:
        report = store.compact(keep=needed[s.name])
        print(
            f"{s.name} cache: removed {report.num_entries_removed} entries, rewrote {report.num_shards_rewritten} "
            f"shard(s); {_size(report.bytes_before)} -> {_size(report.bytes_after)}",
            file=out,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="simpletuner cache", description="List, verify and remove a config's caches.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", required=True, help="the training JSON whose caches to act on")
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, as `simpletuner train --set` does",
        )

    p = sub.add_parser("verify", help="list the caches and check every entry's checksum (exit 1 on corruption)")
    common(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--content",
        action="store_true",
        help="also hash the source file of every latent this config needs and compare it with the hash "
        "recorded when it was encoded (finds files edited in place with size and mtime kept; reads "
        "every image once); exit 1 when some changed",
    )
    p.add_argument(
        "--fix",
        action="store_true",
        help="with --content: remove the latents whose source changed, so the next run re-encodes them "
        "(refuses while a run uses the cache); exit 0 once removed",
    )
    p.add_argument(
        "--wait", action="store_true", help="with --fix: wait for runs using the cache to end instead of refusing"
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("clear", help="remove the caches (asks first; --yes when not on a terminal)")
    common(p)
    p.add_argument(
        "--stale-only",
        action="store_true",
        help="keep the sound entries this config needs; remove stale, corrupt and superseded ones",
    )
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument(
        "--wait",
        action="store_true",
        help="while a training run uses the cache, wait for it to end (without it: refuse, exit 2)",
    )
    p.set_defaults(func=cmd_clear)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``simpletuner cache ...``; returns the exit status."""
    from simpletuner.configuration import ConfigError
    from simpletuner.diskspace import NoSpace

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NoSpace as error:  # a compaction or repair rewriting shards on a full disk (exit 5)
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
