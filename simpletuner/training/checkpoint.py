"""Resumable checkpoints: written to a temporary folder, completed by a marker, then renamed.

Layout of ``checkpoint-<step>/``::

    trainable.safetensors   trained parameters (LoRA weights, or the whole denoiser)
    pytorch_lora_weights*.safetensors
                            LoRA runs: the adapter as the final save writes it (the family's
                            diffusers ``load_lora_weights`` format, or LyCORIS' own), so any
                            checkpoint can be used as it is; full fine-tunes have none
    optimizer.pt            optimizer state (loaded with weights_only=True)
    lr_scheduler.pt         schedule state
    trainer_state.json      step, samples seen, sampler position, accumulation, run identity
    rng_state_<rank>.pt     torch / cuda / numpy / python RNGs and the noise generator, per rank
    COMPLETE                written last; a folder without it is never resumed from

``<output_dir>/latest`` names the newest complete checkpoint. Old checkpoints are removed only
after the new one is complete.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson
import torch
from safetensors.torch import load_file, save_file

from simpletuner.file_modes import ordinary_permissions
from simpletuner.training.reliability import fault_point

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION = 2  # 2: denoiser config in the identity, skipped steps, AMP scaler
MARKER = "COMPLETE"
LATEST = "latest"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# --- RNG ----------------------------------------------------------------------------------
def capture_rng(generator: torch.Generator) -> dict[str, Any]:
    """Every RNG the run draws from, in a form torch.load(weights_only=True) accepts."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- discovery ----------------------------------------------------------------------------
def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        m = _NAME.match(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def find_latest(output_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names if it is complete, else the newest complete one, else None."""
    pointer = output_dir / LATEST
    if pointer.is_file():
        named = output_dir / pointer.read_text().strip()
        if is_complete(named):
            return named
        logger.warning("%s names %s, which is not a complete checkpoint; using the newest complete one", pointer, named)
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def resolve_resume(output_dir: Path, resume_from_checkpoint: str) -> Path | None:
    """The checkpoint ``resume_from_checkpoint`` names: ``latest`` (None when ``output_dir`` holds
    no complete checkpoint) or a folder."""
    if resume_from_checkpoint == LATEST:
        return find_latest(output_dir)
    return Path(resume_from_checkpoint).expanduser()


# --- save ---------------------------------------------------------------------------------
def save_checkpoint(
    accelerator,
    output_dir: Path,
    step: int,
    trainable: dict[str, torch.Tensor],
    optimizer,
    lr_scheduler,
    trainer_state: dict[str, Any],
    generator: torch.Generator,
    total_limit: int | None,
    scaler=None,
    write_adapter: Callable[[Path], Any] | None = None,
) -> Path:
    """Save collectively (every rank calls it); returns the final checkpoint folder.

    Everything goes into a hidden temp folder, is fsynced, gets a COMPLETE marker written last,
    and is renamed into place; only then does ``latest`` move and retention delete old ones.
    A kill at any point leaves the previous checkpoint complete and named by ``latest``.
    ``write_adapter(folder)`` (rank 0) writes the loadable adapter into the temp folder, so it is
    fsynced and covered by the marker like every other file.
    """
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(capture_rng(generator), tmp / f"rng_state_{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        save_file({k: v.detach().cpu().contiguous() for k, v in trainable.items()}, tmp / "trainable.safetensors")
        ordinary_permissions(tmp / "trainable.safetensors")  # safetensors writes 0600
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(lr_scheduler.state_dict(), tmp / "lr_scheduler.pt")
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        if write_adapter is not None:
            write_adapter(tmp)
        state = dict(trainer_state, format_version=CHECKPOINT_FORMAT_VERSION, world_size=accelerator.num_processes)
        (tmp / "trainer_state.json").write_bytes(orjson.dumps(state, option=orjson.OPT_INDENT_2))
    accelerator.wait_for_everyone()
    fault_point("checkpoint:files_written")
    if accelerator.is_main_process:
        for f in tmp.iterdir():
            if not f.is_file():
                continue
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _write_atomic(tmp / MARKER, b"ok\n")
        _fsync_dir(tmp)
        fault_point("checkpoint:marker_written")
        if final.exists():  # re-saving a step after a resume: the new one replaces it whole
            old = output_dir / f".checkpoint-{step}.old"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(output_dir)
        fault_point("checkpoint:renamed")
        _write_atomic(output_dir / LATEST, final.name.encode())
        fault_point("checkpoint:latest_written")
        apply_retention(output_dir, total_limit)
        logger.info("saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final


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
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER} marker): it was interrupted while saving")
    state = orjson.loads((path / "trainer_state.json").read_bytes())
    if state.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise ValueError(f"{path} has checkpoint format {state.get('format_version')}, this version reads {CHECKPOINT_FORMAT_VERSION}")
    return state


#: What a checkpoint written before these identity keys existed trained with.
_IDENTITY_DEFAULTS = {"lycoris_algo": None, "base_model_precision": "no_change", "train_stages": "both"}


def _saved_identity_value(saved_identity: dict[str, Any], key: str) -> Any:
    if key in saved_identity:
        return saved_identity[key]
    if key == "lora_type":  # the only adapter there was, for LoRA runs
        return "standard" if saved_identity.get("training_type") == "lora" else None
    return _IDENTITY_DEFAULTS.get(key)


def identity_differences(state: dict[str, Any], identity: dict[str, Any]) -> list[str]:
    """How the run identity a checkpoint stores differs from ``identity`` (only its keys are compared)."""
    saved_identity = state.get("identity", {})
    problems = []
    for key, value in identity.items():
        saved = _saved_identity_value(saved_identity, key)
        if saved != value:
            problems.append(f"{key}: checkpoint has {saved!r}, config has {value!r}")
    return problems


class ResumeRefused(ValueError):
    """A checkpoint that does not fit this run. Every rank finds the same: rank 0 alone prints it."""


def check_compatible(state: dict[str, Any], identity: dict[str, Any], world_size: int, path: Path) -> None:
    """Raise ResumeRefused (a ValueError) naming every way the checkpoint does not fit this run, and the fix."""
    problems = identity_differences(state, identity)
    saved_world = state.get("world_size")
    if saved_world != world_size:
        problems.append(f"world size: checkpoint was written by {saved_world} process(es), this run has {world_size}")
    if problems:
        fixes = []
        if saved_world != world_size and isinstance(saved_world, int):
            fixes.append(f"launch with the checkpoint's {saved_world} process(es) "
                         f"(`accelerate launch --num_processes {saved_world} ...`) to continue it")
        if len(problems) > (saved_world != world_size):
            fixes.append("put the settings above back to the checkpoint's values to continue it")
        fixes += [f"set a new `output_dir` to start a new run beside it ({path} stays as it is)",
                  "or set `resume_from_checkpoint: null` and pass `--overwrite` to train from scratch "
                  "(it replaces the run in `output_dir`)"]
        raise ResumeRefused(f"cannot resume from {path}: it does not fit this run:\n  - " + "\n  - ".join(problems)
                            + "\nTo fix: " + "; ".join(fixes) + ".")


def load_tensors(path: Path, process_index: int) -> dict[str, Any]:
    """The checkpoint's tensors and states for this rank."""
    rng_file = path / f"rng_state_{process_index}.pt"
    if not rng_file.is_file():
        raise ValueError(f"{path} has no RNG state for process {process_index}")
    return {
        "trainable": load_file(path / "trainable.safetensors"),
        "optimizer": torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True),
        "lr_scheduler": torch.load(path / "lr_scheduler.pt", map_location="cpu", weights_only=True),
        "rng": torch.load(rng_file, map_location="cpu", weights_only=True),
        **({"scaler": torch.load(path / "scaler.pt", map_location="cpu", weights_only=True)}
           if (path / "scaler.pt").is_file() else {}),
    }
