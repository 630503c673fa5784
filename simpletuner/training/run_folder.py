"""One output_dir, one run: find what an earlier run left there, refuse to write over it unless
asked, and remove it when asked (``--overwrite``).

``--overwrite`` removes exactly what runs write at the top of ``output_dir`` (documentation/RELIABILITY.md,
"One output_dir, one run") and keeps every other file and the caches. The trainer takes the folder with
:func:`lock_output_dir` then :func:`take_output_dir`, and ends with :func:`save_final_weights`; each gives
every rank the same outcome, so no rank waits in a collective for one that stopped.
"""

from __future__ import annotations

import logging
import re
import shutil
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from simpletuner import locks
from simpletuner.diskspace import NoSpace
from simpletuner.models.spec import FINAL_RECORD, FINAL_SAVE_PREFIX, final_weights_step
from simpletuner.ranks import from_main_process
from simpletuner.training import checkpoint as ckpt
from simpletuner.training.ema import EMA_FOLDER
from simpletuner.training.run_identity import describe_run, identity_differences
from simpletuner.training.sharded_state import is_sharded, unsharded_copy

logger = logging.getLogger(__name__)

#: Files and folders every run writes at the top of output_dir, besides checkpoints and weights.
RUN_FILES = ("config.json", "training.log", "metrics.jsonl", "gh200_runtime.json", ckpt.LATEST, FINAL_RECORD)
RUN_FOLDERS = ("validation", "logs", EMA_FOLDER)
#: checkpoint-N folders and the temp / replaced copies of saves (``.checkpoint-N.tmp-<token>``,
#: ``.checkpoint-N.old-<token>``; older versions wrote them without a token).
_CHECKPOINT_ENTRY = re.compile(r"^\.?checkpoint-\d+(\.(tmp|old)(-[0-9a-f]+)?)?$")
#: A pointer or manifest write's temp file (``.latest.tmp-<pid>``).
_POINTER_TEMP = re.compile(r"^\.latest\.tmp(-\d+)?$")


@dataclass
class PreviousRun:
    """What an earlier run left in an output_dir."""

    checkpoints: list[Path] = field(default_factory=list)  # complete ones, oldest first
    final_weights: list[Path] = field(default_factory=list)  # adapters / model folders of a finished run

    @property
    def is_empty(self) -> bool:
        return not (self.checkpoints or self.final_weights)

    def describe(self) -> str:
        parts = []
        if self.checkpoints:
            last = self.checkpoints[-1]
            parts.append(f"{len(self.checkpoints)} checkpoint(s), the newest {last.name}")
        if self.final_weights:
            parts.append("finished-run weights " + ", ".join(p.name for p in self.final_weights))
        return " and ".join(parts)


class RunFolderTaken(ValueError):
    """output_dir holds another run (or this one, finished): the same answer on every rank."""


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def final_weights(output_dir: Path) -> list[Path]:
    """The weights a finished run saves at the top of ``output_dir`` (adapters, model folders)."""
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.glob("*.safetensors") if p.is_file()]
    found += [
        p
        for p in output_dir.iterdir()
        if p.is_dir()
        and not _CHECKPOINT_ENTRY.match(p.name)
        and p.name not in RUN_FOLDERS
        and not p.name.startswith(FINAL_SAVE_PREFIX)
        and _is_model_folder(p)
    ]  # a save's temp: not finished
    return sorted(found)


def find_previous_run(output_dir: Path) -> PreviousRun:
    return PreviousRun(ckpt.list_checkpoints(output_dir), final_weights(output_dir))


def _options(output_dir: Path, can_resume: bool) -> str:
    options = []
    if can_resume:
        options.append(
            'continue it: set resume_from_checkpoint "latest" (e.g. --set resume_from_checkpoint=latest; '
            "raise max_train_steps to train longer)"
        )
    options.append("keep it: pick another output_dir for this run")
    options.append(
        f"replace it: pass --overwrite (removes its checkpoints, weights, validation images and logs from "
        f"{output_dir}; other files there are kept)"
    )
    return "\n  - ".join([""] + options)


def check_output_dir(output_dir: Path, resume_from_checkpoint: str | None, identity: dict[str, Any]) -> None:
    """Raise a ValueError when this run would write over another run's results in ``output_dir``.

    Without ``resume_from_checkpoint``, any complete checkpoint or finished-run weights there
    belong to another run (or to this one, started again from step 0). With ``latest`` and no
    checkpoint, finished-run weights there cannot be resumed from. ``identity`` (the trainer's
    run identity, without what needs the loaded model) names how the earlier run differs.
    """
    if resume_from_checkpoint not in (None, ckpt.LATEST):
        return  # an explicit checkpoint: the user chose where to continue from
    previous = find_previous_run(output_dir)
    if previous.is_empty:
        return
    if resume_from_checkpoint == ckpt.LATEST:
        if previous.checkpoints:
            return
        raise RunFolderTaken(
            f"output_dir {output_dir} holds {previous.describe()} but no checkpoint, so resume_from_checkpoint "
            f'"latest" has nothing to continue from, and this run would write over them. Either:'
            + _options(output_dir, can_resume=False)
        )
    why, resumable = "", bool(previous.checkpoints)
    if previous.checkpoints:  # compared with the checkpoint "latest" would resume: the newest that verifies
        why, resumable = _why_not_resumable(output_dir, identity)
    raise RunFolderTaken(
        f"output_dir {output_dir} already holds a run: {previous.describe()}{why}. This run (no "
        f"resume_from_checkpoint) would start from step 0 and write over it. Either:"
        + _options(output_dir, can_resume=resumable)
    )


def _why_not_resumable(output_dir: Path, identity: dict[str, Any]) -> tuple[str, bool]:
    """What to add to the refusal about the checkpoint "latest" would resume (its run id and seed,
    and how it differs from this config), and whether this config could resume it."""
    latest, damaged = ckpt.resolve_latest(output_dir)
    if latest is None:
        found = "; ".join(map(str, damaged))
        return f"; none of its checkpoints verifies ({found}), so it cannot be resumed", False
    try:
        state = ckpt.read_trainer_state(latest)
    except ValueError as exc:  # another checkpoint format: it cannot be resumed either
        return f"; {exc}", False
    run = describe_run(state)
    why = f" ({latest.name}: {run})" if run else ""
    differences = identity_differences(state, identity)
    if differences:
        why += "; it was trained with another config (" + "; ".join(differences) + "), so this config cannot resume it"
    return why, not differences


def clear_previous_run(output_dir: Path) -> list[Path]:
    """``--overwrite``: remove what earlier runs wrote in ``output_dir`` (see the module doc);
    returns the removed paths. Other files are kept."""
    if not output_dir.is_dir():
        return []
    doomed = [p for p in output_dir.iterdir() if _CHECKPOINT_ENTRY.match(p.name) and p.is_dir()]
    doomed += final_weights(output_dir)
    doomed += [p for p in output_dir.iterdir() if p.name.startswith(FINAL_SAVE_PREFIX)]  # of a killed final save
    doomed += [output_dir / name for name in RUN_FILES if (output_dir / name).is_file()]
    doomed += [p for p in output_dir.iterdir() if _POINTER_TEMP.match(p.name) and p.is_file()]
    doomed += [output_dir / name for name in RUN_FOLDERS if (output_dir / name).is_dir()]
    for path in sorted(set(doomed)):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if doomed:
        logger.warning(
            "--overwrite: removed the previous run from %s: %s",
            output_dir,
            ", ".join(sorted(p.name for p in set(doomed))),
        )
    return doomed


def check_overwrite(output_dir: Path, resume_from_checkpoint: str | None) -> None:
    """``--overwrite`` with an explicit checkpoint inside ``output_dir``: it would remove what it resumes."""
    if resume_from_checkpoint in (None, ckpt.LATEST):
        return  # 'latest' then finds nothing: the run starts afresh
    if output_dir.resolve() in Path(resume_from_checkpoint).expanduser().resolve().parents:
        raise RunFolderTaken(
            f"--overwrite would remove {resume_from_checkpoint}, which resume_from_checkpoint names: "
            "drop one of the two"
        )


def finished_step(output_dir: Path, resume_from_checkpoint: str | None, total_steps: int | None) -> int | None:
    """The step of the checkpoint to resume from when it is already at or past ``total_steps``
    (the run is finished: this says so, and the caller trains and saves nothing); else None.
    The checkpoint is the one the resume would load (verified: see ``checkpoint.resolve_resume``),
    so a damaged one is reported here, before anything loads."""
    if not resume_from_checkpoint or total_steps is None:
        return None
    path = ckpt.resolve_resume(output_dir, resume_from_checkpoint)
    if path is None:
        return None
    step = ckpt.read_trainer_state(path)["global_step"]
    if step < total_steps:
        return None
    saved_at = final_weights_step(output_dir)
    if not final_weights(output_dir) or (saved_at is not None and saved_at < step):
        # the final save after this checkpoint never completed (a full disk, a kill): resume only to write it
        held = f"its final weights are of step {saved_at}" if final_weights(output_dir) else "it holds no final weights"
        logger.warning("%s is at step %d but %s: resuming only to save them", path, step, held)
        return None
    logger.warning(
        "%s is at step %d and this run trains to step %d: already finished, nothing to train; nothing was saved "
        "or changed. To train longer, raise max_train_steps (e.g. --set max_train_steps=%d)",
        path,
        step,
        total_steps,
        step + max(total_steps, 1),
    )
    return step


#: ``storage_options`` entries that are secrets (s3fs, gcsfs, adlfs names): not copied into output_dir.
SECRET_OPTIONS = frozenset({"key", "secret", "token", "password", "account_key", "sas_token", "client_secret"})
REDACTED = "<not copied: give it in the environment or the original config>"


def without_secrets(raw_config: dict[str, Any]) -> dict[str, Any]:
    """``raw_config`` with the secret ``storage_options`` of its datasets replaced by :data:`REDACTED`
    (output folders get shared; object-store credentials must not travel with them)."""
    datasets = raw_config.get("datasets")
    if not isinstance(datasets, list):
        return raw_config
    cleaned = []
    for entry in datasets:
        options = entry.get("storage_options") if isinstance(entry, dict) else None
        if isinstance(options, dict) and SECRET_OPTIONS & set(options):
            hidden = {name: REDACTED if name in SECRET_OPTIONS else value for name, value in options.items()}
            entry = {**entry, "storage_options": hidden}
        cleaned.append(entry)
    return {**raw_config, "datasets": cleaned}


def write_run_config(output_dir: Path, raw_config: dict[str, Any]) -> None:
    """``output_dir/config.json``: the config this run trains with, as loaded (rank 0), without
    object-store secrets (:func:`without_secrets`)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.json").write_bytes(orjson.dumps(without_secrets(raw_config), option=orjson.OPT_INDENT_2))


def lock_output_dir(accelerator, output_dir: Path, held: ExitStack) -> None:
    """Lock ``output_dir`` for this run (rank 0; the lock joins ``held``, see simpletuner/locks.py).
    When it is taken, every rank raises (exit 2; rank 0 alone prints it): none hangs in a collective."""
    refusal = None
    if accelerator.is_main_process:
        try:
            held.enter_context(locks.hold_output_dir(output_dir))
        except ValueError as exc:  # FolderLocked, or a lock file that cannot be created
            refusal = exc
    text = from_main_process(accelerator, None if refusal is None else str(refusal))
    if text is not None and refusal is None:
        refusal = RunFolderTaken(text)  # printed by rank 0 alone (train.main)
    if refusal is not None:
        raise refusal


def take_output_dir(
    accelerator, output_dir: Path, resume_from_checkpoint: str | None, identity: dict[str, Any], overwrite: bool
) -> None:
    """Refuse to write over another run's results in the locked ``output_dir`` (:func:`check_output_dir`),
    or with ``overwrite`` remove them first (rank 0; the others wait). The lock comes first, so
    ``--overwrite`` never removes what a live run writes."""
    if not overwrite:
        check_output_dir(output_dir, resume_from_checkpoint, identity)
        return
    check_overwrite(output_dir, resume_from_checkpoint)
    if accelerator.is_main_process:
        clear_previous_run(output_dir)
    accelerator.wait_for_everyone()


def save_final_weights(accelerator, spec, model, output_dir: Path, full: bool, step: int, ema=None) -> Path | None:
    """Rank 0 saves the final adapter (or model, ``full``) of ``model`` (unwrapped) whole or not at
    all (``ModelSpec.save_final``); returns its path there, None on the other ranks. With ``ema``
    (rank 0's :class:`~simpletuner.training.ema.EMA`) the averaged weights follow, saved the same way
    under ``output_dir/ema`` (the family's loader reads that folder as it reads ``output_dir``). A
    full disk on rank 0 raises NoSpace on every rank: they agree on the outcome first. Under FSDP
    every rank first joins the gather of the whole weights into a plain copy on rank 0, which saves it."""
    accelerator.wait_for_everyone()
    if is_sharded(accelerator):
        model = unsharded_copy(model)  # collective: rank 0 gets the whole model, the others None
    path, failure = None, None
    if accelerator.is_main_process:
        try:
            path = spec.save_final(output_dir, model, full=full, step=step)
            if ema is not None:
                with ema.applied():
                    ema_path = spec.save_final(output_dir / EMA_FOLDER, model, full=full)
                logger.info("saved the EMA weights: %s", ema_path)
        except NoSpace as exc:
            failure = exc
    fields = (
        None
        if failure is None
        else (failure.what, str(failure.folder), failure.needed, failure.free, failure.during_write)
    )  # picklable: NoSpace(message) is not
    fields = from_main_process(accelerator, fields)
    if fields is not None:
        if failure is not None:
            raise failure
        what, folder, needed, free, during_write = fields
        raise NoSpace(what, Path(folder), needed, free, during_write, agreed=True)
    accelerator.wait_for_everyone()
    return path
