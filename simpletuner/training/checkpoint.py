"""Resumable checkpoints of a run: found, verified, saved and restored.

A save (:class:`Checkpointer`, collective) writes ``checkpoint-<step>/`` into a temp folder of this launch,
completes it with the ``COMPLETE`` manifest (:mod:`~simpletuner.training.checkpoint_verify`) and renames it
into place; only then do ``latest`` and retention move. A kill or a full disk at any point leaves the previous
checkpoint complete and named by ``latest``. A resume (:func:`resolve_resume`, :func:`restore_parts`) reads
only a checkpoint that verifies, and every file before any state changes. The layout and the reasoning:
documentation/RELIABILITY.md, "Checkpoints verify themselves".
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import orjson
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from simpletuner import diskspace
from simpletuner.file_modes import ordinary_permissions, write_atomic
from simpletuner.models.adapters import trainable_state
from simpletuner.ranks import from_every_process, from_main_process
from simpletuner.training.checkpoint_verify import (  # noqa: F401 - ResumeRefused, Damage: callers import them from here
    _ATOMIC_TEMP,
    MARKER,
    STATE_FILE,
    CheckpointDamaged,
    Damage,
    ResumeRefused,
    _plain_reason,
    _warn_once,
    build_manifest,
    verify_checkpoint,
)
from simpletuner.training.ema import EMA_FILE
from simpletuner.training.reliability import fault_point
from simpletuner.training.rng import capture_rng, restore_rng
from simpletuner.training.run_identity import check_compatible
from simpletuner.training.sharded_state import SHARDS, is_sharded, load_shards, save_shards, write_placeholders

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION = 2  # 2: denoiser config in the identity, skipped steps, AMP scaler
LATEST = "latest"
#: Bytes of the small files of a save (schedule, state JSON, scaler), on top of each rank's RNG file.
SMALL_FILES_BYTES = 2**20
RNG_FILE_BYTES = 64 * 2**10
_NAME = re.compile(r"^checkpoint-(\d+)$")
#: What a save leaves behind when its process dies: its temp folder, or the previous copy of a
#: step it was replacing. ``.checkpoint-N.tmp`` / ``.old`` without a token: older versions.
TEMP_ENTRY = re.compile(r"^\.checkpoint-(\d+)\.(tmp|old)(-[0-9a-f]+)?$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- discovery ----------------------------------------------------------------------------
def is_complete(path: Path) -> bool:
    """Whether the save of ``path`` finished (its manifest exists); :func:`verify_checkpoint` checks the files."""
    return (path / MARKER).is_file()


def _step(path: Path) -> int:
    match = _NAME.match(path.name)
    assert match is not None, path  # _checkpoint_folders keeps checkpoint-N names only
    return int(match.group(1))


def _inside(path: Path, folder: Path) -> bool:
    return folder.resolve() in path.resolve().parents


def _checkpoint_folders(output_dir: Path) -> list[Path]:
    """``checkpoint-N`` folders of ``output_dir`` (complete or not), oldest first; links leading
    out of ``output_dir`` are left out."""
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        if not (_NAME.match(child.name) and child.is_dir()):
            continue
        if child.is_symlink() and not _inside(child, output_dir):
            _warn_once("%s is a link to %s, outside %s: it is not resumed from", child, child.resolve(), output_dir)
            continue
        found.append(child)
    return sorted(found, key=_step)


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints (their save finished), oldest first. Not verified: see :func:`resolve_latest`."""
    return [p for p in _checkpoint_folders(output_dir) if is_complete(p)]


def _pointer(output_dir: Path) -> Path | None:
    """The folder ``latest`` names, when it is a plain ``checkpoint-N`` folder inside ``output_dir``."""
    pointer = output_dir / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text(encoding="utf-8", errors="replace").strip()
    except OSError as exc:
        _warn_once("%s cannot be read (%s): using the newest checkpoint that verifies", pointer, exc.strerror)
        return None
    if not _NAME.match(name):
        _warn_once(
            "%s names %r, which is not a checkpoint-N folder of %s: ignored; using the newest checkpoint that verifies",
            pointer,
            name[:200],
            output_dir,
        )
        return None
    target = output_dir / name
    if target.is_symlink() and not _inside(target, output_dir):
        _warn_once(
            "%s names %s, a link leading out of %s: ignored; using the newest checkpoint that verifies",
            pointer,
            target,
            output_dir,
        )
        return None
    if not target.is_dir():
        _warn_once("%s names %s, which does not exist: using the newest checkpoint that verifies", pointer, name)
        return None
    return target


def resolve_latest(output_dir: Path) -> tuple[Path | None, list[Damage]]:
    """The checkpoint ``latest`` resolves to and the damaged ones passed over on the way.

    The folder ``latest`` names comes first, then every other ``checkpoint-N``, newest first; the
    first that verifies wins. ``(None, [])``: no checkpoint at all; ``(None, damages)``: none verifies.
    """
    named = _pointer(output_dir)
    others = [p for p in reversed(_checkpoint_folders(output_dir)) if p != named]
    order = ([named] if named is not None else []) + others
    damaged: list[Damage] = []
    for path in order:
        damage = verify_checkpoint(path)
        if damage is None:
            for bad in damaged:
                _warn_once(
                    "checkpoint %s cannot be resumed from: %s. Using %s, the newest checkpoint that verifies",
                    bad.checkpoint.name,
                    bad,
                    path.name,
                )
            return path, damaged
        damaged.append(damage)
    return None, damaged


def find_latest(output_dir: Path) -> Path | None:
    """The checkpoint ``resume_from_checkpoint: "latest"`` continues from, or None when none verifies."""
    return resolve_latest(output_dir)[0]


def resolve_resume(output_dir: Path, resume_from_checkpoint: str) -> Path | None:
    """The verified checkpoint ``resume_from_checkpoint`` names: ``latest`` (None when ``output_dir``
    holds no checkpoint) or a folder. Raises :class:`CheckpointDamaged` when the folder named, or
    with ``latest`` every checkpoint there, fails its checks."""
    if resume_from_checkpoint == LATEST:
        path, damaged = resolve_latest(output_dir)
        if path is None and damaged:
            raise CheckpointDamaged(
                f"cannot resume: no checkpoint in {output_dir} verifies:\n  - "
                + "\n  - ".join(map(str, damaged))
                + "\nTo fix: put the named files back from a backup (or copy in a checkpoint that verifies) and run "
                "again; or start afresh: set `resume_from_checkpoint: null` and pass `--overwrite` (removes these "
                "checkpoints), or set a new `output_dir`."
            )
        return path
    path = Path(resume_from_checkpoint).expanduser()
    damage = verify_checkpoint(path)
    if damage is not None:
        raise CheckpointDamaged(
            f"cannot resume from {path}: {damage}. Nothing was loaded.\nTo fix: put that file back from a backup; "
            f'or set `resume_from_checkpoint: "latest"` to continue from the newest checkpoint in `output_dir` '
            "that verifies, or name an older checkpoint folder."
        )
    return path


# --- one launch ---------------------------------------------------------------------------
def remove_stale_temp_folders(output_dir: Path) -> list[Path]:
    """Remove what saves of dead processes left in ``output_dir`` (temp folders, ``.old`` copies,
    pointer temp files). Call it only while holding output_dir: a live save's temp folder looks the same.

    A ``.checkpoint-N.old-*`` whose ``checkpoint-N`` is gone is a re-save of step N killed between
    its two renames: that complete copy is put back instead of removed.
    """
    if not output_dir.is_dir():
        return []
    removed = []
    for child in sorted(output_dir.iterdir()):
        match = TEMP_ENTRY.match(child.name)
        if match is None and not (_ATOMIC_TEMP.match(child.name) and child.is_file()):
            continue
        final = output_dir / f"checkpoint-{match.group(1)}" if match else None
        if match and match.group(2) == "old" and final is not None and not final.exists() and is_complete(child):
            os.replace(child, final)
            logger.warning("put %s back as %s: a save was stopped while replacing it", child.name, final.name)
            continue
        diskspace.remove_path(child)
        removed.append(child)
    if removed:
        logger.info(
            "removed %d folder(s) left by an interrupted save in %s: %s",
            len(removed),
            output_dir,
            ", ".join(p.name for p in removed),
        )
    return removed


def start_launch(accelerator, output_dir: Path) -> tuple[str, str]:
    """Once per launch, after output_dir is this run's: rank 0 removes what dead saves left there
    and makes a run id (kept unless a resume adopts the checkpoint's) and this launch's temp-folder
    token. Returns ``(run_id, token)``, the same on every rank."""
    ids = None
    if accelerator.is_main_process:
        remove_stale_temp_folders(output_dir)
        ids = (uuid.uuid4().hex[:8], uuid.uuid4().hex[:12])
    agreed = from_main_process(accelerator, ids)
    assert agreed is not None  # rank 0 made them
    return agreed


# --- save ---------------------------------------------------------------------------------
def checkpoint_bytes(trainable: dict[str, torch.Tensor], optimizer, with_adapter: bool, num_processes: int) -> int:
    """Bytes a save is about to write: the trainable tensors, the optimizer's state tensors, the
    adapter copy (LoRA runs; about the trainable tensors again), the small files and the RNG files."""

    def size(t) -> int:
        return t.numel() * t.element_size() if torch.is_tensor(t) else 0

    weights = sum(size(t) for t in trainable.values())
    moments = sum(size(v) for state in optimizer.state.values() for v in state.values())
    return weights * (2 if with_adapter else 1) + moments + SMALL_FILES_BYTES + RNG_FILE_BYTES * num_processes


def _attempt(fn: Callable[[], Any]) -> tuple | None:
    """Run ``fn``: None if it worked, else what went wrong, in a form every rank can act on."""
    try:
        fn()
    except diskspace.NoSpace as exc:
        return ("no_space", exc.what, str(exc.folder), exc.needed, exc.free, exc.during_write)
    except Exception as exc:  # noqa: BLE001 - re-raised on this rank, described to the others
        return ("error", f"{type(exc).__name__}: {exc}", exc)
    return None


def _settle(accelerator, mine: tuple | None, tmp: Path, main_only: bool = False) -> None:
    """Agree on a step of the save (rank 0's outcome with ``main_only``, else every rank's) and,
    when any rank failed, raise on every rank after rank 0 removed ``tmp``: no rank is left
    waiting in a collective for one that gave up. A full disk is the same NoSpace everywhere."""
    shareable = mine[:2] if mine is not None and mine[0] == "error" else mine  # the exception stays here
    if accelerator.num_processes <= 1:
        outcomes = [shareable]
    elif main_only:
        outcomes = [from_main_process(accelerator, shareable)]
    else:
        outcomes = from_every_process(accelerator, shareable)
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
    if not failed:
        return
    if accelerator.is_main_process:
        diskspace.remove_path(tmp)
    rank, outcome = failed[0]
    if outcome[0] == "no_space":
        _, what, folder, needed, free, during = outcome
        raise diskspace.NoSpace(what, Path(folder), needed, free, during_write=during, agreed=mine is None)
    if mine is not None and mine[0] == "error":
        raise mine[2]
    raise RuntimeError(f"{tmp.name} could not be written: process {rank} failed: {outcome[1]}")


def _move_into_place(tmp: Path, final: Path, token: str) -> None:
    """Rename the complete temp folder to ``final``; a re-save of a step (after a resume) replaces
    the old folder whole (see remove_stale_temp_folders for a kill between the two renames)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{token}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


@dataclass
class CheckpointContents:
    """What one save writes: the tensors and states of a checkpoint's files (see RELIABILITY.md for the layout)."""

    trainable: dict[str, torch.Tensor]  # trainable.safetensors
    optimizer: Any  # optimizer.pt
    lr_scheduler: Any  # lr_scheduler.pt
    trainer_state: dict[str, Any]  # trainer_state.json (the format version and world size are added)
    generator: torch.Generator  # rng_state_<rank>.pt, with the process RNGs
    scaler: Any = None  # scaler.pt: the AMP grad scaler of fp16 runs
    ema: dict[str, torch.Tensor] | None = None  # ema.safetensors
    write_adapter: Callable[[Path], Any] | None = None  # rank 0: the loadable adapter, into the folder given
    write_shards: Callable[[Path], Any] | None = None  # FSDP, every rank (collective): the sharded state

    def num_bytes(self, num_processes: int) -> int:
        """Bytes the save is about to write (:func:`checkpoint_bytes`, and the EMA's tensors)."""
        needed = checkpoint_bytes(self.trainable, self.optimizer, self.write_adapter is not None, num_processes)
        return needed + sum(t.numel() * t.element_size() for t in (self.ema or {}).values())


@dataclass
class Checkpointer:
    """Saves a run's checkpoints into ``output_dir``: built once per launch with what every save needs
    (``token``: this launch's temp-folder token, see :func:`start_launch`)."""

    accelerator: Any
    output_dir: Path
    total_limit: int | None  # checkpoints_total_limit: retention after each save
    token: str

    def save(
        self,
        step: int,
        parts: CheckpointParts,
        *,
        run_id: str,
        identity: dict[str, Any],
        write_adapter: Callable[[Path], Any] | None = None,
    ) -> Path:
        """:meth:`write` ``parts`` at ``step`` (collective), the run's id and identity in its state."""
        trainer_state = {
            **parts.progress.state_dict(),
            "sampler": parts.sampler.state_dict(),
            "accumulation": parts.accumulation.state_dict(),
            "run_id": run_id,
            "identity": identity,
        }
        sharded = is_sharded(self.accelerator)
        contents = CheckpointContents(
            trainable_state(parts.model),
            parts.optimizer,
            parts.lr_scheduler,
            trainer_state,
            parts.generator,
            scaler=parts.scaler,
            ema=parts.ema.state_dict() if parts.ema is not None else None,
            write_adapter=write_adapter,
            write_shards=(lambda d: save_shards(d, parts.model, parts.optimizer)) if sharded else None,
        )
        return self.write(step, contents)

    def write(self, step: int, contents: CheckpointContents) -> Path:
        """Write ``contents`` as ``checkpoint-<step>`` (every rank calls it); returns the final folder.

        Each step of the save is agreed by every rank before the next (:func:`_settle`): rank 0 makes the
        temp folder, every rank writes its files, rank 0 completes and renames it. A rank that fails makes
        every rank raise, after rank 0 removed the temp folder; a full disk is the same NoSpace everywhere.
        """
        save = _Save(self, step, contents)
        acc = self.accelerator
        main = acc.is_main_process
        _settle(acc, _attempt(save.prepare) if main else None, save.tmp, main_only=True)
        outcome = _attempt(save.write_rank_files)
        if main and outcome is None:
            outcome = _attempt(save.write_main_files)
        _settle(acc, outcome, save.tmp)
        fault_point("checkpoint:files_written")
        _settle(acc, _attempt(save.complete) if main else None, save.tmp, main_only=True)
        if main:
            logger.info("saved checkpoint %s", save.final)
        return save.final


class _Save:
    """One save's named steps, each run under the full-disk guard that removes the temp folder."""

    def __init__(self, checkpointer: Checkpointer, step: int, contents: CheckpointContents):
        self.checkpointer, self.step, self.contents = checkpointer, step, contents
        self.accelerator, self.output_dir = checkpointer.accelerator, checkpointer.output_dir
        self.final = self.output_dir / f"checkpoint-{step}"
        self.tmp = self.output_dir / f".checkpoint-{step}.tmp-{checkpointer.token}"
        self.needed = contents.num_bytes(self.accelerator.num_processes)

    def guard(self):
        return diskspace.disk_full_guard(self.output_dir, self.needed, self.final.name, cleanup=[self.tmp])

    def prepare(self) -> None:
        """Rank 0: check the free space, then make the temp folder afresh."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        diskspace.require_space(self.output_dir, self.needed, self.final.name)
        with self.guard():
            if self.tmp.exists():  # an earlier save of this step in this launch that failed
                shutil.rmtree(self.tmp)
            self.tmp.mkdir()

    def write_rank_files(self) -> None:
        """Every rank: its RNG file and, FSDP, its shards."""
        contents, tmp = self.contents, self.tmp
        with self.guard():
            torch.save(capture_rng(contents.generator), tmp / f"rng_state_{self.accelerator.process_index}.pt")
            if contents.write_shards is not None:
                contents.write_shards(tmp)

    def write_main_files(self) -> None:
        """Rank 0: the weights, optimizer, schedule, scaler, EMA, adapter and trainer state."""
        contents, tmp = self.contents, self.tmp
        with self.guard():
            if contents.write_shards is None:
                weights = {k: v.detach().cpu().contiguous() for k, v in contents.trainable.items()}
                save_file(weights, tmp / "trainable.safetensors")
                torch.save(contents.optimizer.state_dict(), tmp / "optimizer.pt")
            else:  # the state is in shards/
                write_placeholders(tmp)
            diskspace.inject_fault("checkpoint")  # tests: the disk fills once the first file is written
            ordinary_permissions(tmp / "trainable.safetensors")  # safetensors writes 0600
            if contents.ema is not None:  # rank 0's EMA (training/ema.py)
                save_file({k: v.detach().cpu().contiguous() for k, v in contents.ema.items()}, tmp / EMA_FILE)
                ordinary_permissions(tmp / EMA_FILE)
            torch.save(contents.lr_scheduler.state_dict(), tmp / "lr_scheduler.pt")
            if contents.scaler is not None:
                torch.save(contents.scaler.state_dict(), tmp / "scaler.pt")
            if contents.write_adapter is not None:
                contents.write_adapter(tmp)
            world_size = self.accelerator.num_processes
            state = dict(contents.trainer_state, format_version=CHECKPOINT_FORMAT_VERSION, world_size=world_size)
            (tmp / STATE_FILE).write_bytes(orjson.dumps(state, option=orjson.OPT_INDENT_2))

    def complete(self) -> None:
        """Rank 0: fsync, write the manifest, rename into place, move ``latest``, apply retention."""
        tmp, final = self.tmp, self.final
        with self.guard():
            for f in tmp.rglob("*"):
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            write_atomic(tmp / MARKER, build_manifest(tmp, self.step))
            _fsync_dir(tmp)
        fault_point("checkpoint:marker_written")
        _move_into_place(tmp, final, self.checkpointer.token)
        fault_point("checkpoint:renamed")
        with diskspace.disk_full_guard(self.output_dir, self.needed, final.name):  # the new checkpoint is complete
            write_atomic(self.output_dir / LATEST, final.name.encode())
        fault_point("checkpoint:latest_written")
        apply_retention(self.output_dir, self.checkpointer.total_limit)


def apply_retention(output_dir: Path, total_limit: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``total_limit`` (never the newest)."""
    if not total_limit:
        return []
    found = list_checkpoints(output_dir)
    doomed = found[: max(len(found) - total_limit, 0)]
    for path in doomed:
        shutil.rmtree(path)
        logger.info("removed old checkpoint %s (checkpoints_total_limit=%d)", path, total_limit)
    return doomed


# --- load ---------------------------------------------------------------------------------
def read_trainer_state(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of a complete checkpoint (call :func:`resolve_resume` first to verify it)."""
    if not is_complete(path):
        raise CheckpointDamaged(
            f"{path} is not a complete checkpoint (no {MARKER} manifest): it was interrupted "
            "while saving, or the file was deleted"
        )
    file = path / STATE_FILE
    try:
        state = orjson.loads(file.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise CheckpointDamaged(f"cannot read {file}: {_plain_reason(exc)}") from None
    if not isinstance(state, dict):
        raise CheckpointDamaged(f"{file} does not hold a trainer state")
    if state.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise ResumeRefused(
            f"{path} has checkpoint format {state.get('format_version')}, this version reads "
            f"{CHECKPOINT_FORMAT_VERSION}"
        )
    return state


def _read(path: Path, name: str, reader: Callable[[Path], Any]) -> Any:
    """``reader(path / name)``; a file that cannot be read is CheckpointDamaged naming it."""
    file = path / name
    try:
        return reader(file)
    except FileNotFoundError:
        raise CheckpointDamaged(
            f"cannot resume from {path}: {name} is missing. Nothing was loaded. To fix: put it "
            "back, or resume from an older checkpoint"
        ) from None
    except Exception as exc:  # noqa: BLE001 - torch / safetensors raise many types for a bad file
        raise CheckpointDamaged(
            f"cannot resume from {path}: {file} cannot be read ({_plain_reason(exc)}). Nothing was loaded. To fix: "
            "put that file back from a backup, or resume from an older checkpoint (resume_from_checkpoint "
            '"latest" takes the newest one that verifies)'
        ) from None


def _torch_file(file: Path) -> Any:
    return torch.load(file, map_location="cpu", weights_only=True)


def load_tensors(path: Path, process_index: int, with_ema: bool = False) -> dict[str, Any]:
    """The checkpoint's tensors and states for this rank, all read before the caller applies any
    (so a file that cannot be read leaves the run as it was); ``with_ema``: its EMA too, if saved."""
    rng_name = f"rng_state_{process_index}.pt"
    if not (path / rng_name).is_file():
        raise CheckpointDamaged(f"{path} has no RNG state for process {process_index} ({rng_name})")
    return {
        "trainable": _read(path, "trainable.safetensors", load_file),
        "optimizer": _read(path, "optimizer.pt", _torch_file),
        "lr_scheduler": _read(path, "lr_scheduler.pt", _torch_file),
        "rng": _read(path, rng_name, _torch_file),
        **({"scaler": _read(path, "scaler.pt", _torch_file)} if (path / "scaler.pt").is_file() else {}),
        **({"ema": _read(path, EMA_FILE, load_file)} if with_ema and (path / EMA_FILE).is_file() else {}),
    }


# --- the run's parts: saved and restored in the same places --------------------------------
@dataclass
class CheckpointParts:
    """The live objects a checkpoint holds: :meth:`Checkpointer.save` writes them and :func:`restore_parts`
    puts them back, in place. ``model``'s trained parameters (``trainable_state``) and the noise
    ``generator`` (with the process RNGs, per rank) aside, each has ``state_dict`` / ``load_state_dict``."""

    model: nn.Module  # unwrapped from DDP
    optimizer: Any
    lr_scheduler: Any
    generator: torch.Generator
    progress: Any  # the run's counters: their keys are trainer_state.json's top level
    sampler: Any
    accumulation: Any  # recorded, not restored: a resume under another schedule is warned about
    scaler: Any = None  # the AMP grad scaler of fp16 runs
    ema: Any = None  # use_ema, rank 0: training.ema.EMA (state_dict / load_state_dict / reset)


def restore_parts(path: Path, accelerator, parts: CheckpointParts, identity: dict[str, Any]) -> dict[str, Any]:
    """Put ``parts`` back as the checkpoint ``path`` (verified: :func:`resolve_resume`) saved them;
    returns its trainer state. A checkpoint that does not fit ``identity`` or this world size is
    refused, and every file is read before any part changes."""
    state = read_trainer_state(path)
    check_compatible(state, identity, accelerator.num_processes, path)
    if state.get("accumulation") != parts.accumulation.state_dict():
        logger.warning(
            "resuming with a different accumulation schedule (checkpoint %s, config %s): the run continues, "
            "but not with the window sequence it started with",
            state.get("accumulation"),
            parts.accumulation.state_dict(),
        )
    sharded = is_sharded(accelerator)
    if sharded != (path / SHARDS).is_dir():
        how = ("with", "without") if sharded else ("without", "with")
        raise ResumeRefused(f"{path} was saved {how[0]} FSDP and this run is launched {how[1]}: launch as it was saved")
    tensors = load_tensors(path, accelerator.process_index, with_ema=parts.ema is not None)
    if not sharded and set(tensors["trainable"]) != set(trainable_state(parts.model)):
        raise ValueError(f"{path}: trained parameters do not match this model (different adapter or model?)")
    ema_problem = parts.ema.mismatch(tensors["ema"]) if "ema" in tensors else None
    if ema_problem:
        raise ValueError(f"{path}/{EMA_FILE}: {ema_problem}")
    if sharded:  # every rank its slice (collective)
        load_shards(path, parts.model, parts.optimizer)
    else:
        parts.model.load_state_dict(tensors["trainable"], strict=False)
        parts.optimizer.load_state_dict(tensors["optimizer"])
    parts.lr_scheduler.load_state_dict(tensors["lr_scheduler"])
    parts.sampler.load_state_dict(state["sampler"])
    restore_rng(tensors["rng"], parts.generator)
    parts.progress.load_state_dict(state)
    if parts.scaler is not None and "scaler" in tensors:
        parts.scaler.load_state_dict(tensors["scaler"])
    if parts.ema is not None:
        if "ema" in tensors:
            parts.ema.load_state_dict(tensors["ema"])
        else:  # use_ema turned on for a run saved without it
            parts.ema.reset()
            logger.warning(
                "%s holds no %s (the run was saved without use_ema): the EMA starts from the resumed weights",
                path,
                EMA_FILE,
            )
    return state
