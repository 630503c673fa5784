"""Run folders read as runs: what the web UI lists, charts and serves. Read-only: never takes a lock, never writes.

A run folder holds ``config.json`` (the config as it ran) and at least one of ``metrics.jsonl``,
``training.log`` or the output_dir lock. Its state comes from the lock (a live holder: running), the final
weights record (finished), and the last lines of ``training.log`` (stopped by a signal, or failed). Every file
the UI serves goes through :func:`resolve_file`, which keeps it inside the run folder.
See documentation/ARCHITECTURE.md, "ui".
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import orjson

from simpletuner.locks import OUTPUT_LOCK_NAME, FolderLock, Holder
from simpletuner.training import checkpoint as ckpt
from simpletuner.training.run_folder import final_weights
from simpletuner.training.runlog import LOG_FILE, METRICS_FILE

#: Written beside the final weights once they are in place (simpletuner.models.spec.FINAL_RECORD).
FINAL_RECORD = "final_weights.json"
#: The picture `simpletuner demo` writes after training (testing.demo_data.write_before_after).
BEFORE_AFTER = "before_after.png"
MAX_DEPTH = 4  # folders below the runs root searched for run folders
#: Folders never searched: a run's own sub-folders, caches, environments.
_SKIPPED = re.compile(r"^(\..*|checkpoint-\d+.*|validation|logs|ema|cache|__pycache__|node_modules|site-packages)$")
#: RunLog's last line when a run ends with an exception; a signal's message starts with "stopped by SIG..."
_STOPPED = re.compile(r"run stopped: (Preempted|Interrupted): stopped by SIG[A-Z]+")
_ENDED = re.compile(r"run stopped: ")
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (\w+) ([\w.]+): (.*)$")
#: training.log messages that say where a setting came from (the trainer's settings in force, a preset,
#: a translated dialect's approximations, the family read from the model folder).
_SOURCE = re.compile(
    r"( in force\b|, from |\bfrom \S+ in the environment| taken from |preset|key approximated:|forced:)"
)
_VALIDATION = re.compile(r"^step_(\d+)(.*)\.png$")
_TAIL_BYTES = 8192  # the end of training.log (the state) and of metrics.jsonl (a summary) read


class UnknownRun(KeyError):
    """No run folder with this id under the runs root."""


class FileOutsideRun(ValueError):
    """A file path that leaves the run folder (absolute, '..', or a symlink pointing out)."""


@dataclass
class RunSummary:
    """One row of the runs table."""

    id: str  # the run folder relative to the runs root, '/'-separated
    path: Path
    state: str  # "running" | "finished" | "stopped" | "failed"
    step: int | None
    total: int | None
    eta_s: float | None
    last_loss: float | None
    samples_per_s: float | None
    mfu: float | None
    started: float | None  # epoch seconds
    model_family: str | None
    config_name: str | None

    def to_json(self) -> dict:
        out = asdict(self)
        out["path"] = str(self.path)
        return out


# --- finding runs ------------------------------------------------------------------------------------
def is_run_folder(folder: Path) -> bool:
    """``config.json`` and one of ``metrics.jsonl``, ``training.log``, the output_dir lock."""
    return (folder / "config.json").is_file() and any(
        (folder / name).is_file() for name in (METRICS_FILE, LOG_FILE, OUTPUT_LOCK_NAME)
    )


def _walk(root: Path) -> Iterator[Path]:
    """Run folders under ``root`` (itself included), at most :data:`MAX_DEPTH` below it, symlinks not followed."""
    stack = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        if is_run_folder(folder):
            yield folder
            continue  # a run's sub-folders (checkpoints, validation) are no runs
        if depth >= MAX_DEPTH:
            continue
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and not _SKIPPED.match(entry.name):
                stack.append((Path(entry.path), depth + 1))


def _run_id(root: Path, folder: Path) -> str:
    rel = folder.relative_to(root).as_posix()
    return "." if rel in ("", ".") else rel


def find_runs(root: Path) -> list[RunSummary]:
    """Every run folder under ``root``, newest first (by start, else by the folder's last change)."""
    root = Path(root).resolve()
    found = [_summary(root, folder) for folder in _walk(root)]
    return sorted(found, key=lambda s: s.started or 0.0, reverse=True)


def run_path(root: Path, run_id: str) -> Path:
    """The folder of ``run_id`` under ``root``; :class:`UnknownRun` when it is not a run folder inside root."""
    root = Path(root).resolve()
    parts = [p for p in run_id.split("/") if p not in ("", ".")]
    if Path(run_id).is_absolute() or ".." in parts or len(parts) > MAX_DEPTH:
        raise UnknownRun(run_id)
    folder = root.joinpath(*parts)
    try:
        resolved = folder.resolve(strict=True)
    except (OSError, RuntimeError):
        raise UnknownRun(run_id) from None
    if not resolved.is_relative_to(root) or not is_run_folder(resolved):
        raise UnknownRun(run_id)
    return resolved


def run_summary(root: Path, run_id: str) -> RunSummary:
    """The summary of one run; :class:`UnknownRun` when there is none by that id."""
    root = Path(root).resolve()
    return _summary(root, run_path(root, run_id))


# --- reading a run -----------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


def read_config(run: Path) -> dict:
    """The config as it ran (``config.json``), or {} when unreadable."""
    config = _read_json(Path(run) / "config.json")
    return config if isinstance(config, dict) else {}


def lock_holder(run: Path) -> Holder | None:
    """The live process holding ``run``'s output_dir lock (read from the lock file; the lock is not taken), or None.

    A holder on another host is never known to be gone, so it counts as live."""
    path = Path(run) / OUTPUT_LOCK_NAME
    if not path.is_file():
        return None
    holder = FolderLock(path).holder(retries=0)
    return None if holder is None or holder.is_gone() else holder


def tail_lines(path: Path, num_bytes: int = _TAIL_BYTES) -> list[str]:
    """The lines in the last ``num_bytes`` of a text file (the first, cut, left out)."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - num_bytes))
            data = file.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[1:] if size > num_bytes else lines


def run_state(run: Path) -> str:
    """running (a live lock holder) | finished (final weights recorded) | stopped (a signal) | failed."""
    run = Path(run)
    if lock_holder(run) is not None:
        return "running"
    if (run / FINAL_RECORD).is_file():
        return "finished"
    ended = [line for line in tail_lines(run / LOG_FILE) if _ENDED.search(line)]
    if ended and _STOPPED.search(ended[-1]):
        return "stopped"
    return "failed"


def metrics(run: Path) -> list[dict]:
    """Every record of ``metrics.jsonl`` (a half-written last line is left out)."""
    lines, _ = read_new(Path(run) / METRICS_FILE, 0)
    return _records(lines)


def recent_metrics(run: Path) -> list[dict]:
    """The last records of ``metrics.jsonl``, from its last bytes only: what a summary needs (the last step,
    loss and speed, the ETA's few step times), without reading a long run's whole file at each refresh."""
    return _records(tail_lines(Path(run) / METRICS_FILE))


def _records(lines: list[str]) -> list[dict]:
    records = []
    for line in lines:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_new(path: Path, offset: int) -> tuple[list[str], int]:
    """The complete lines appended to ``path`` since byte ``offset``, and the offset after the last of them.

    A partial last line (still being written) is not returned: the next call, from the returned offset,
    gets it whole. A file that shrank below ``offset`` (rewritten) is read from its start."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            if offset > size:
                offset = 0
            file.seek(offset)
            data = file.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    complete = data[: end + 1]
    return complete.decode("utf-8", errors="replace").splitlines(), offset + len(complete)


def _number(record: dict, key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _eta(records: list[dict], step: int | None, total: int | None) -> float | None:
    """Seconds left: the steps left times the mean step time of the last few logging windows."""
    if step is None or total is None or step >= total:
        return None
    recent = [t for t in (_number(r, "step_time_s") for r in records[-5:]) if t is not None]
    if recent:
        return (total - step) * sum(recent) / len(recent)
    timed = [(r["step"], r["time"]) for r in records[-6:] if isinstance(r.get("step"), int) and _number(r, "time")]
    if len(timed) >= 2 and timed[-1][0] > timed[0][0]:
        per_step = (timed[-1][1] - timed[0][1]) / (timed[-1][0] - timed[0][0])
        return (total - step) * per_step
    return None


def _started(run: Path) -> float | None:
    """When the run first started: training.log's first timestamp, else config.json's mtime."""
    try:
        with open(run / LOG_FILE, "rb") as file:
            first = file.readline().decode("utf-8", errors="replace")
        match = _LOG_LINE.match(first.rstrip("\n"))
        if match:
            return datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(match[2]) / 1000
    except (OSError, ValueError):
        pass
    try:
        return (run / "config.json").stat().st_mtime
    except OSError:
        return None


def _checkpoint_step(path: Path) -> int | None:
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(match[1]) if match else None


def _summary(root: Path, run: Path) -> RunSummary:
    config = read_config(run)
    records = recent_metrics(run)
    last = records[-1] if records else {}
    steps = [s for s in (_checkpoint_step(p) for p in ckpt.list_checkpoints(run)) if s is not None]
    if isinstance(last.get("step"), int):
        steps.append(last["step"])
    final = _read_json(run / FINAL_RECORD)
    if isinstance(final, dict) and isinstance(final.get("step"), int):
        steps.append(final["step"])
    step = max(steps) if steps else None
    total = config.get("max_train_steps") if isinstance(config.get("max_train_steps"), int) else None
    state = run_state(run)
    family = config.get("model_family")
    return RunSummary(
        id=_run_id(root, run),
        path=run,
        state=state,
        step=step,
        total=total,
        eta_s=_eta(records, step, total) if state == "running" else None,
        last_loss=_number(last, "loss"),
        samples_per_s=_number(last, "samples_per_s"),
        mfu=_number(last, "mfu"),  # the trainer's own figure; absent where the GPU's peak is unknown (CPU)
        started=_started(run),
        model_family=family if isinstance(family, str) else None,
        config_name=_config_name(run, config),
    )


def _config_name(run: Path, config: dict) -> str | None:
    """The run's name: the tracker_project_name its config sets, else the run folder's name."""
    name = config.get("tracker_project_name")
    return name if isinstance(name, str) and name else run.name or None


# --- one run in full ---------------------------------------------------------------------------------
def _file_entry(run: Path, path: Path) -> dict:
    return {"path": path.relative_to(run).as_posix(), "bytes": path.stat().st_size}


def _files_under(run: Path, folder: Path) -> list[dict]:
    return [_file_entry(run, p) for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()]


def sources(run: Path) -> list[str]:
    """training.log's lines saying where settings came from, in order, for the latest launch: a resumed run logs
    them again at each start (with the setting's name before the first comma), and only the last start's hold."""
    lines, _ = read_new(Path(run) / LOG_FILE, 0)
    launch: dict[str, str] = {}  # the setting's name -> its message, in the order said
    for line in lines:
        match = _LOG_LINE.match(line)
        message = match[5] if match else None
        if message and _SOURCE.search(message) and not message.startswith("start-up"):
            name = message.split(",", 1)[0]
            if name in launch:  # said before: a new launch starts here
                launch = {}
            launch[name] = message
    return list(launch.values())


def validation_images(run: Path) -> list[dict]:
    """``[{"step": N, "grid": rel | None, "images": [rel, ...]}]`` by step, from ``validation/step_NNNNNN_*.png``."""
    by_step: dict[int, dict] = {}
    folder = Path(run) / "validation"
    if not folder.is_dir():
        return []
    for path in sorted(folder.glob("step_*.png")):
        match = _VALIDATION.match(path.name)
        if not match or path.is_symlink():
            continue
        entry = by_step.setdefault(int(match[1]), {"step": int(match[1]), "grid": None, "images": []})
        rel = path.relative_to(run).as_posix()
        if match[2].endswith("_grid"):
            if entry["grid"] is None or not match[2][: -len("_grid")]:  # the plain grid before an EMA one
                entry["grid"] = rel
        else:
            entry["images"].append(rel)
    return [by_step[s] for s in sorted(by_step)]


def run_detail(root: Path, run_id: str) -> dict:
    """The run page's content: summary, config as ran, settings' sources, checkpoints, weights, validation."""
    root = Path(root).resolve()
    run = run_path(root, run_id)
    checkpoints = [
        {"name": p.name, "step": _checkpoint_step(p), "files": _files_under(run, p)} for p in ckpt.list_checkpoints(run)
    ]
    weights: list[dict] = []
    for path in final_weights(run):
        weights += [_file_entry(run, path)] if path.is_file() else _files_under(run, path)
    before_after = run / BEFORE_AFTER
    return {
        "summary": _summary(root, run).to_json(),
        "config": read_config(run),
        "sources": sources(run),
        "checkpoints": checkpoints,
        "weights": weights,
        "validation": validation_images(run),
        "before_after": BEFORE_AFTER if before_after.is_file() and not before_after.is_symlink() else None,
    }


def resolve_file(root: Path, run_id: str, rel: str) -> Path:
    """The file ``rel`` (relative, '/'-separated) inside run ``run_id``: the only way the UI reaches a file.

    Raises:
        UnknownRun: no such run under ``root``.
        FileOutsideRun: ``rel`` is absolute, has a '..' part, or resolves (symlinks followed) outside the run.
        FileNotFoundError: no such file inside the run (or a folder).
    """
    run = run_path(root, run_id)
    if not rel or "\x00" in rel or "\\" in rel:
        raise FileOutsideRun(rel)
    path = Path(rel)
    if path.is_absolute() or rel.startswith("/") or ".." in path.parts:
        raise FileOutsideRun(rel)
    try:
        resolved = (run / path).resolve(strict=True)
    except FileNotFoundError:
        raise FileNotFoundError(rel) from None
    except (OSError, RuntimeError):  # a symlink loop, a name too long
        raise FileOutsideRun(rel) from None
    if not resolved.is_relative_to(run):
        raise FileOutsideRun(rel)
    if not resolved.is_file():
        raise FileNotFoundError(rel)
    return resolved
