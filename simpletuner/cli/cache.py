"""``simpletuner cache verify|clear --config cfg.json``: list, check and remove a config's caches.

The folders and needed keys are the ones training uses (:class:`~simpletuner.caching.routing.CacheFolders`,
:func:`simpletuner.caching.keys.cache_keys`), so ``clear --stale-only`` keeps exactly what training reads.
``verify`` (no lock) checks checksums and what is stored against what the config needs; ``--content`` hashes
each needed latent's source, ``--fix`` removes the changed ones. ``clear`` and ``--fix`` hold the cache
(:mod:`simpletuner.locks`). Exit 0 all well; 1 corruption, changed sources kept, or a removal declined; 2 a
usage or config error. Flags and output: documentation/RELIABILITY.md, "Caches".
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import orjson

from simpletuner.caching import layout
from simpletuner.caching.keys import CacheKeys, cache_keys
from simpletuner.caching.layout import CACHE_NAMES, EPOCH_CACHE_NAME, TEXT_CACHE_NAME, VAE_CACHE_NAME
from simpletuner.caching.markers import MARKER_SUFFIX
from simpletuner.caching.report import (
    CacheSummary,
    check_sources,
    format_size,
    inspect_cache,
    note_unreadable,
    print_content,
    print_removable,
    print_summary,
    summary_json,
)
from simpletuner.caching.routing import CacheFolders
from simpletuner.caching.shard_checks import QUARANTINE_SUFFIX
from simpletuner.caching.store import SHARD_GLOB, ShardedTensorStore
from simpletuner.cli.arguments import add_config_arguments
from simpletuner.configuration.cache_paths import trained_datasets
from simpletuner.data_backend import RegisteredDataset, build_metadata, build_source_backend
from simpletuner.data_backend.pairs import check_model_inputs
from simpletuner.locks import CacheLocks
from simpletuner.precision import run_dtype

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)


def _spec(config: "TrainingConfig"):
    """The model spec of ``config`` (its family and encoder identities name the cache folder and keys);
    imported here, as ``simpletuner --help`` imports no model library."""
    from simpletuner.models import get_model_spec

    return get_model_spec(config)


def cache_base(config: "TrainingConfig") -> Path:
    """``<cache_dir>/<model_family>``, as training opens it (:func:`simpletuner.caching.layout.cache_base`)."""
    return layout.cache_base(config.cache_config.cache_dir, _spec(config).family)


def cache_folders(config: "TrainingConfig") -> CacheFolders:
    """Every cache folder of ``config`` (:class:`~simpletuner.caching.routing.CacheFolders`), as training opens them."""
    return CacheFolders.of(config, _spec(config).family)


def needed_keys(config: "TrainingConfig") -> dict[str, set[str]]:
    """``{"vae": latent keys, "text": text keys}`` the config needs now: those
    :func:`simpletuner.caching.keys.cache_keys` names, the keys training reads.

    Datasets are scanned where they are, without staging
    (:func:`~simpletuner.data_backend.factory.build_source_backend`: an ``in_memory`` dataset's keys use the
    file identities of its folder or object store; object stores are listed, shards indexed). Captions of
    images that turn out to be undecodable at encode time are still counted, so such entries show as missing.

    Raises:
        ValueError: the config has no datasets, a dataset scan fails, or an encoder folder is unusable.
        OSError: a folder cannot be read.
    """
    return _scan_needed(config)[0]


def _scan_needed(config: "TrainingConfig") -> tuple[dict[str, set[str]], dict[str, tuple[Any, Any]]]:
    """:func:`needed_keys`, and ``{latent key: (dataset, sample)}`` to find each latent's source."""
    keys = config_keys(config)
    return keys.needed(), keys.latent_sources()


def config_keys(config: "TrainingConfig") -> CacheKeys:
    """:func:`~simpletuner.caching.keys.cache_keys` of ``config``, its datasets scanned where they are
    (see :func:`needed_keys`), text embeddings in the precision training would use on this machine."""
    if not config.datasets:
        raise ValueError("the config has no `datasets`")
    spec = _spec(config)
    check_model_inputs(spec, config)  # what training refuses, before a scan
    text_dtype = run_dtype(config)
    datasets = []
    for dataset_cfg in trained_datasets(config):  # `disabled` / `probability: 0` ones: never scanned
        backend = build_source_backend(dataset_cfg, config)  # in place: object store, shards, folder
        metadata = build_metadata(backend, dataset_cfg, config, seed=config.seed)
        datasets.append(RegisteredDataset(dataset_cfg.id, dataset_cfg, backend, metadata))
    return cache_keys(spec, datasets, text_dtype)


def _load(args: argparse.Namespace):
    from simpletuner.configuration import load_config

    return load_config(args.config, args.overrides, check_files=False).config


@dataclass
class _Inspection:
    summaries: list[CacheSummary]
    stores: list[ShardedTensorStore | None]
    needed: list[set[str]] | None  # per summary: the keys the config needs in that folder
    why_not_needed: str | None  # why the needed keys could not be computed


def _inspect_all(config: "TrainingConfig", content: bool = False) -> _Inspection:
    """Inspect every cache folder of ``config`` (the default latent folder, each dataset's own, the text
    folder); with ``content`` also hash the latents' sources."""
    folders = cache_folders(config)
    vae_folders = folders.all_vae_folders()
    sources: dict[str, tuple[Any, Any]] = {}
    needed: list[set[str]] | None
    try:
        keys = config_keys(config)
        by_folder, sources = folders.latents_by_folder(keys), keys.latent_sources()
        needed = [*(by_folder[f] for f in vae_folders), keys.needed()[TEXT_CACHE_NAME]]
        why_not = None
    except (ValueError, OSError, ImportError) as error:  # ImportError: an object store's package is missing
        needed, why_not = None, str(error)
    places = [*((VAE_CACHE_NAME, f) for f in vae_folders), (TEXT_CACHE_NAME, folders.text)]
    pairs = [
        inspect_cache(name, folder, needed[i] if needed is not None else None)
        for i, (name, folder) in enumerate(places)
    ]
    if needed is not None:  # missing entries whose image does not decode: "unreadable (skipped)", not "encoded"
        note_unreadable([p[0] for p in pairs], [p[1] for p in pairs], needed, keys)
    if content and needed is not None:
        for i, (summary, store) in enumerate(pairs[: len(vae_folders)]):
            if store is not None:
                check_sources(summary, store, {key: sources[key] for key in needed[i]})
            else:
                summary.num_content_checked = summary.num_content_unhashed = 0
    return _Inspection([p[0] for p in pairs], [p[1] for p in pairs], needed, why_not)


def _fix_changed(config: "TrainingConfig", inspection: _Inspection, wait: bool) -> None:
    """``--fix``: remove the latents whose source changed, so the next run re-encodes them. The cache
    is held as ``cache clear`` holds it: a run reading a shard while it is rewritten would fail.

    Raises:
        FolderLocked (a ValueError): a run uses the cache and ``wait`` is False.
    """
    folders = cache_folders(config)
    for summary, store in zip(inspection.summaries, inspection.stores):
        if summary.name != VAE_CACHE_NAME or store is None or not summary.content_changed:
            continue
        locks = CacheLocks(folders.lock_base(Path(summary.folder)))
        with locks.clearing(wait=wait, say=lambda message: print(message, file=sys.stderr)):
            removed = summary.num_content_removed = store.remove(list(summary.content_changed))
        summary.num_entries -= removed  # the counts describe the cache as the command leaves it
        summary.num_ok -= removed
        if summary.num_present is not None and summary.num_missing is not None:
            summary.num_present, summary.num_missing = summary.num_present - removed, summary.num_missing + removed


def cmd_verify(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """List and check the caches of ``args.config``; 1 when an entry or shard is damaged, or (with
    ``--content``) a latent's source changed and ``--fix`` did not remove it."""
    out = out or sys.stdout
    content, fix = args.content, args.fix
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
        _fix_changed(config, inspection, args.wait)
    is_corrupt = any(s.has_corruption for s in summaries)
    num_changed = sum(len(s.content_changed) for s in summaries if s.has_changed_content)
    status = 1 if is_corrupt else 2 if content_error else 1 if num_changed else 0
    if args.json:
        payload: dict[str, Any] = {
            "config": str(args.config),
            "is_clean": not is_corrupt and not num_changed,
            "needed_keys_error": why_not,
            "content_checked": content and not content_error,
            "caches": [summary_json(s) for s in summaries],
        }
        out.write(orjson.dumps(payload, option=orjson.OPT_INDENT_2).decode() + "\n")
        return status
    if why_not:
        print(f"note: cannot tell which entries this config needs ({why_not}); checksums are still checked", file=out)
    for summary in summaries:
        print_summary(summary, out)
        if summary.num_content_checked is not None:
            print_content(summary, out)
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
            f"all entries are sound. `simpletuner cache clear --config {args.config} --stale-only` "
            "frees the stale ones.",
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
    with ``--wait`` waits for them to end. ``--dry-run`` lists what would go (every entry, with
    --stale-only) and removes nothing; like ``verify`` it takes no lock."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    config = _load(args)
    folders = cache_folders(config)
    custom = [f for f in [*folders.all_vae_folders(), folders.text] if folders.is_custom(f)]
    # Nothing there to protect (or nothing removed): locking would create the folder.
    bases = sorted({b for b in [folders.base, *custom] if b.is_dir()}) if not args.dry_run else []
    with contextlib.ExitStack() as held:
        locks = {}
        for base in bases:  # sorted: every clear and run takes them in one order
            locks[base] = CacheLocks(base)
            held.enter_context(locks[base].clearing(wait=args.wait, say=lambda line: print(line, file=out, flush=True)))
        if args.stale_only:
            return _clear_stale(config, args, stdin, out)
        return _clear_all(folders, custom, locks, args, stdin, out)


def _store_files(folder: Path) -> list[Path]:
    """The files a cache store writes in ``folder`` (shards, damaged shards moved aside, unfinished
    writes, markers): what ``clear`` removes from a folder a config key named, which may hold other files."""
    patterns = (SHARD_GLOB, SHARD_GLOB + QUARANTINE_SUFFIX, ".tmp-shard-*", f"*{MARKER_SUFFIX}")
    return sorted({p for pattern in patterns for p in folder.glob(pattern) if p.is_file()})


def _clear_all(
    folders: CacheFolders,
    custom: list[Path],
    locks: dict[Path, CacheLocks],
    args: argparse.Namespace,
    stdin: TextIO,
    out: TextIO,
) -> int:
    base = folders.base
    whole = [base / name for name in (*CACHE_NAMES, EPOCH_CACHE_NAME) if (base / name).exists()]
    parts = {folder: _store_files(folder) for folder in custom if folder.is_dir()}
    parts = {folder: files for folder, files in parts.items() if files}
    if not whole and not parts:
        listed = ", ".join(str(p) for p in [base, *custom])
        print(f"nothing to remove: no caches under {listed}", file=out)
        return 0
    dry_run = args.dry_run
    print("would remove:" if dry_run else "will remove:", file=out)
    for folder in whole:
        files = [p for p in folder.rglob("*") if p.is_file()]
        print(f"  {folder}  ({len(files)} files, {format_size(sum(p.stat().st_size for p in files))})", file=out)
    for folder, files in parts.items():
        size = format_size(sum(p.stat().st_size for p in files))
        print(f"  the cache files in {folder}  ({len(files)} files, {size})", file=out)
    if dry_run:
        print(_DRY_RUN_DONE, file=out)
        return 0
    status = _confirm("remove these folders?", args.yes, stdin, out)
    if status is not None:
        return status
    for folder in whole:
        shutil.rmtree(folder)
    for files in parts.values():
        for path in files:
            path.unlink(missing_ok=True)
    for held in locks.values():
        held.remove_if_empty()  # a folder goes too when only the locks were left in it
    print(f"removed {len(whole) + len(parts)} cache folder(s)", file=out)
    return 0


def _clear_stale(config: "TrainingConfig", args: argparse.Namespace, stdin: TextIO, out: TextIO) -> int:
    inspection = _inspect_all(config)
    needed = inspection.needed
    if needed is None:
        print(
            f"error: cannot tell which entries this config needs ({inspection.why_not_needed}); "
            "--stale-only needs that. Fix the config, or remove everything without --stale-only",
            file=sys.stderr,
        )
        return 2
    plan = [
        (s, store, keep)
        for s, store, keep in zip(inspection.summaries, inspection.stores, needed)
        if store is not None and s.num_removable
    ]
    if not plan:
        print("nothing to remove: every stored entry is sound and needed by this config", file=out)
        return 0
    dry_run = args.dry_run
    print("would remove:" if dry_run else "will remove:", file=out)
    for s, _, _ in plan:
        parts = [f"{len(s.stale or ())} stale", f"{len(s.corrupt)} corrupt", f"{s.num_superseded} superseded"]
        damaged = len(s.unreadable_shards) + len(s.quarantined_files)
        print(f"  {s.name} cache {s.folder}: {', '.join(parts)} entries, {damaged} damaged file(s)", file=out)
        if dry_run:
            print_removable(s, out)
        elif s.stale:
            print(f"    stale e.g.: {', '.join(s.stale[:3])}", file=out)
    if dry_run:
        print(_DRY_RUN_DONE, file=out)
        return 0
    status = _confirm("rewrite these caches?", args.yes, stdin, out)
    if status is not None:
        return status
    for s, store, keep in plan:
        report = store.compact(keep=keep)
        print(
            f"{s.name} cache: removed {report.num_entries_removed} entries, rewrote {report.num_shards_rewritten} "
            f"shard(s); {format_size(report.bytes_before)} -> {format_size(report.bytes_after)}",
            file=out,
        )
    return 0


_DRY_RUN_DONE = "dry run: nothing removed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simpletuner cache``'s sub-commands and their options."""
    parser.description = "List, verify and remove a config's caches."
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        add_config_arguments(
            p,
            required=True,
            config_help="the training JSON whose caches to act on",
            set_help="override a config key, as `simpletuner train --set` does",
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
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list what would be removed (with --stale-only: every entry, one a line) and remove nothing",
    )
    p.set_defaults(func=cmd_clear)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m simpletuner.cli.cache``."""
    parser = argparse.ArgumentParser(prog="simpletuner cache")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``simpletuner cache ARGV``; returns the exit status."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """``simpletuner cache`` from the parsed arguments; returns the exit status."""
    from simpletuner.configuration import ConfigError
    from simpletuner.diskspace import NoSpace

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
