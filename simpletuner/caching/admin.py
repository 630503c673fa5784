"""``simpletuner cache verify|clear --config cfg.json``: list, check and remove a config's caches.

The caches of a config live in ``<cache_dir>/<model_family>/{vae,text}``. ``verify`` opens
each one read-only, checks every entry against the checksum recorded when it was written,
and compares what is stored with what the config needs now (the dataset is scanned and the
keys built the way training builds them), so after a VAE change the old latents show up as
stale. ``clear`` removes both caches, or with ``--stale-only`` rewrites them to hold only
the sound entries the config needs.

Exit status: 0 all is well (missing and stale entries are not errors), 1 corruption found
(or a removal declined), 2 a usage or config error (including ``clear`` without ``--yes``
when stdin is not a terminal).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, TextIO

import orjson

from simpletuner.caching.store import ShardedTensorStore
from simpletuner.caching.text_cache import caption_text_key
from simpletuner.caching.vae_cache import sample_latent_key

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)

CACHE_NAMES = ("vae", "text")
_MAX_LISTED = 20


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

    @property
    def has_corruption(self) -> bool:
        return bool(self.corrupt or self.unreadable_shards)

    @property
    def num_removable(self) -> int:
        """What ``clear --stale-only`` would remove: entries, superseded copies and damaged files."""
        return (len(self.stale or ()) + len(self.corrupt) + self.num_superseded + len(self.unreadable_shards)
                + len(self.quarantined_files))


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
    latent_keys: set[str] = set()
    captions: set[str] = set()
    for dataset_cfg in config.datasets:
        backend = build_local_backend(dataset_cfg, config)
        metadata = build_metadata(backend, dataset_cfg, config, seed=config.seed)
        dataset = RegisteredDataset(dataset_cfg.id, dataset_cfg, backend, metadata)
        for sample in metadata.samples:
            latent_keys.add(sample_latent_key(dataset, sample, image_identity, config.resolution, augment=augment))
            captions.add(sample.caption)
    text_keys = {caption_text_key(c, text_identity, text_dtype) for c in captions}
    return {"vae": latent_keys, "text": text_keys}


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
            summary.num_needed, summary.num_present, summary.num_missing, summary.stale = len(needed), 0, len(needed), []
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
        print(f"  stale: {len(s.stale)} entries not needed by this config (e.g. made by another VAE, resolution "
              "or caption; another config sharing this cache folder may still use them)", file=out)
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


def _inspect_all(config: "TrainingConfig") -> _Inspection:
    base = cache_base(config)
    try:
        needed: dict[str, set[str]] | None = needed_keys(config)
        why_not = None
    except (ValueError, OSError) as error:
        needed, why_not = None, str(error)
    pairs = [inspect_cache(name, base / name, needed[name] if needed else None) for name in CACHE_NAMES]
    return _Inspection([p[0] for p in pairs], [p[1] for p in pairs], needed, why_not)


def _as_json(summary: CacheSummary) -> dict[str, Any]:
    """The summary as plain data; the stale list is cut to a sample (it can be millions long)."""
    data = asdict(summary)
    stale = data.pop("stale")
    data["num_stale"] = None if stale is None else len(stale)
    data["stale_sample"] = None if stale is None else stale[:_MAX_LISTED]
    data["has_corruption"] = summary.has_corruption
    return data


def cmd_verify(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """List and check the caches of ``args.config``; 1 when an entry or shard is damaged."""
    out = out or sys.stdout
    inspection = _inspect_all(_load(args))
    summaries, why_not = inspection.summaries, inspection.why_not_needed
    is_corrupt = any(s.has_corruption for s in summaries)
    if args.json:
        payload: dict[str, Any] = {"config": str(args.config), "is_clean": not is_corrupt,
                                   "needed_keys_error": why_not, "caches": [_as_json(s) for s in summaries]}
        out.write(orjson.dumps(payload, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 1 if is_corrupt else 0
    if why_not:
        print(f"note: cannot tell which entries this config needs ({why_not}); checksums are still checked", file=out)
    for summary in summaries:
        _print_summary(summary, out)
    if is_corrupt:
        print(f"corruption found. Damaged entries are re-encoded on the next training run; or remove them now with "
              f"`simpletuner cache clear --config {args.config} --stale-only` (or everything without --stale-only).",
              file=out)
        return 1
    if any(s.stale or s.num_superseded for s in summaries):
        print(f"all entries are sound. `simpletuner cache clear --config {args.config} --stale-only` frees the stale ones.",
              file=out)
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
    """Remove the caches of ``args.config`` (or, with --stale-only, what it does not need)."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    config = _load(args)
    if args.stale_only:
        return _clear_stale(config, args, stdin, out)
    base = cache_base(config)
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
    with contextlib.suppress(OSError):
        base.rmdir()  # only when empty
    print(f"removed {len(folders)} cache folder(s)", file=out)
    return 0


def _clear_stale(config: "TrainingConfig", args: argparse.Namespace, stdin: TextIO, out: TextIO) -> int:
    inspection = _inspect_all(config)
    needed = inspection.needed
    if needed is None:
        print(f"error: cannot tell which entries this config needs ({inspection.why_not_needed}); --stale-only needs that. "
              "Fix the config, or remove everything without --stale-only", file=sys.stderr)
        return 2
    plan = [(s, store) for s, store in zip(inspection.summaries, inspection.stores) if store is not None and s.num_removable]
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
        print(f"{s.name} cache: removed {report.num_entries_removed} entries, rewrote {report.num_shards_rewritten} "
              f"shard(s); {_size(report.bytes_before)} -> {_size(report.bytes_after)}", file=out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="simpletuner cache", description="List, verify and remove a config's caches.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", required=True, help="the training JSON whose caches to act on")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, as `simpletuner train --set` does")

    p = sub.add_parser("verify", help="list the caches and check every entry's checksum (exit 1 on corruption)")
    common(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("clear", help="remove the caches (asks first; --yes when not on a terminal)")
    common(p)
    p.add_argument("--stale-only", action="store_true",
                   help="keep the sound entries this config needs; remove stale, corrupt and superseded ones")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_clear)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``simpletuner cache ...``; returns the exit status."""
    from simpletuner.configuration import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
