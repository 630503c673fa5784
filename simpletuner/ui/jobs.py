"""The web UI's launch queue: check a config, launch it through ``accelerate launch``, stop it, resume it.

One scheduler thread starts queued jobs in order, one at a time (one machine, one GPU); the job at the
head of the queue also waits while another live process holds its output_dir's lock (the lock the trainer
takes decides, read without taking it). A job is a subprocess in its own session, its output in
``workdir/jobs/<id>.log``; its argv is a list, never a shell string. :meth:`JobQueue.check` loads a config
with the loader ``simpletuner train`` uses (every problem in one pass) and estimates its memory as
``simpletuner estimate --json`` does. See documentation/ARCHITECTURE.md, "ui".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from simpletuner.configuration import ConfigError, load_config, validate_config
from simpletuner.configuration.loader import read_config_file, translate_dialect
from simpletuner.testing import demo_data
from simpletuner.ui import runs

#: The ui's demo: short, and checkpointing / validating often enough that a browser sees both.
DEMO_STEPS = 30
DEMO_EVERY = 10
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
_CONFIG_SUFFIXES = (".json", ".yaml", ".yml")
#: Where a launcher's log reports the training process's own exit code: accelerate's simple launcher
#: raises CalledProcessError ("... returned non-zero exit status 143."); torchrun's summary has "exitcode  : 143".
_CHILD_CODE = (re.compile(r"returned non-zero exit status (-?\d+)"), re.compile(r"exitcode\s*:\s*(-?\d+)"))
_STOP_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT)
_POLL_S = 0.25
#: The trainer's entry file, launched as `accelerate launch simpletuner/train.py` (the documented line): a
#: process of the layer above, never imported here.
TRAIN_ENTRY = Path(__file__).resolve().parents[1] / "train.py"


@dataclass
class Job:
    """One launch: queued, running, then done / failed / stopped.

    ``returncode``: the training process's exit code (0, 143 after a stop, 2 bad config, ...), read from the
    launcher's report where it gives one (accelerate's launcher exits 1 for any failure of its child), else
    the launcher's own (``launcher_returncode``)."""

    id: str
    config_path: Path
    output_dir: Path | None
    state: str  # "queued" | "running" | "done" | "failed" | "stopped"
    resume: bool
    pid: int | None
    returncode: int | None
    argv: list[str]
    log_path: Path
    launcher_returncode: int | None = None
    submitted: float = field(default_factory=time.time)
    started: float | None = None
    ended: float | None = None
    waiting_for: str | None = None  # why a queued job has not started: another job, or a lock's holder

    def to_json(self) -> dict:
        out = asdict(self)
        for key in ("config_path", "output_dir", "log_path"):
            out[key] = None if out[key] is None else str(out[key])
        return out


@dataclass
class Checked:
    """What :meth:`JobQueue.check` found: every problem, the dialect, the loader's notes and the estimate."""

    ok: bool
    problems: list[str]
    config_path: Path | None
    output_dir: Path | None
    dialect: str  # "native" | "simpletuner" | "ai-toolkit"
    estimate: dict | None  # `simpletuner estimate --json`'s "estimate" object (the breakdown), or None
    notes: list[str]  # what the dialect's translation approximated, forced or ignored; why no estimate
    estimate_report: dict | None = None  # the whole `estimate --json` answer (machine, total_bytes, fits, ...)
    estimate_text: list[str] = field(default_factory=list)  # `simpletuner estimate`'s text table, line by line

    def to_json(self) -> dict:
        out = asdict(self)
        for key in ("config_path", "output_dir"):
            out[key] = None if out[key] is None else str(out[key])
        return out


def default_processes() -> int:
    """One training process per CUDA device, one without."""
    import torch

    return max(1, torch.cuda.device_count())


def launch_argv(config_path: Path, mixed_precision: str, num_processes: int, resume: bool) -> list[str]:
    """``accelerate launch simpletuner/train.py --config <config_path>`` (+ resume_from_checkpoint=latest)."""
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes)]
    if num_processes > 1:
        argv.append("--multi_gpu")
    argv += ["--num_machines", "1", "--mixed_precision", mixed_precision, "--dynamo_backend", "no"]
    argv += [str(TRAIN_ENTRY), "--config", str(config_path)]
    return argv + (["--set", "resume_from_checkpoint=latest"] if resume else [])


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid ...
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry.name))
    return found


def _signal(pid: int, signum: int = signal.SIGTERM) -> bool:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


class JobQueue:
    """Launch jobs one at a time, in order, from a scheduler thread; stop and resume runs.

    ``workdir``: the UI's own files (configs it wrote, the demo, job logs); ``runs_root``: where runs are
    listed, and where the demo writes its output; ``processes``: training processes per job (default: one
    per CUDA device, one without)."""

    def __init__(self, workdir: Path, runs_root: Path, processes: int | None = None):
        self.workdir = Path(workdir).resolve()
        self.runs_root = Path(runs_root).resolve()
        self.processes = processes
        for folder in ("configs", "jobs"):
            (self.workdir / folder).mkdir(parents=True, exist_ok=True)
        self._jobs: list[Job] = []
        self._procs: dict[str, subprocess.Popen] = {}
        self._stopping: set[str] = set()  # jobs a stop was sent to
        self._demos: set[Path] = set()  # the demos' output_dirs: a finished demo gets its before | after picture
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._schedule, name="simpletuner-ui-jobs", daemon=True)
        self._thread.start()

    # --- checking a config ------------------------------------------------------------------------
    def _config_file(self, text: str, filename: str) -> Path:
        """``workdir/configs/<stem>-<hash of text><suffix>``: the same text, the same file; never one a queued
        job still reads."""
        name = _SAFE_NAME.sub("_", Path(filename or "config.json").name).strip("._") or "config.json"
        stem, suffix = os.path.splitext(name)
        if suffix.lower() not in _CONFIG_SUFFIXES:
            stem, suffix = name, ".json"
        digest = hashlib.sha256(text.encode()).hexdigest()[:10]
        return self.workdir / "configs" / f"{stem or 'config'}-{digest}{suffix.lower()}"

    def check(self, text: str, filename: str = "config.json", estimate: bool = True) -> Checked:
        """Write ``text`` to ``workdir/configs/``, load it as ``simpletuner train`` would (any dialect; every
        problem in one pass) and, when it loads and ``estimate`` is set, estimate its memory."""
        path = self._config_file(text, filename)
        path.write_text(text, encoding="utf-8")
        problems: list[str] = []
        notes: list[str] = []
        dialect = "native"
        config = None
        try:
            dialect, native = _translate(_read_object(path), path, notes)
            config = validate_config(native, base_dir=path.parent, source=str(path))
        except ConfigError as exc:
            problems += exc.problems
        checked = Checked(
            ok=not problems,
            problems=problems,
            config_path=path,
            output_dir=Path(config.output_dir).resolve() if config is not None else None,
            dialect=dialect,
            estimate=None,
            notes=notes,
        )
        if checked.ok and estimate:
            self._estimate(checked)
        return checked

    def with_preset(self, text: str, filename: str, preset: str) -> tuple[str, str, list[str]]:
        """``text`` with a hardware preset merged in as ``simpletuner estimate --preset NAME --apply`` merges it
        (memory.presets.apply_preset: what the config sets wins), as native JSON: a SimpleTuner or ai-toolkit
        config is translated first, as `simpletuner convert` writes it. Returns (text, file name, what each preset
        setting became).

        Raises:
            ConfigError: the text does not read as a config. ValueError: an unknown preset, or one made for
                another model family (naming the presets that fit).
        """
        from simpletuner.memory.presets import apply_preset

        path = self._config_file(text, filename)
        path.write_text(text, encoding="utf-8")
        dialect, native = _translate(_read_object(path), path, [])
        merged, lines = apply_preset(native, preset)
        if dialect != "native":
            lines.insert(0, f"the {dialect} config is translated to a native one first (as `simpletuner convert` does)")
        name = f"{Path(filename or 'config').stem}-{preset}.json"
        return json.dumps(merged, indent=2) + "\n", name, lines

    def _estimate(self, checked: Checked) -> None:
        """``simpletuner estimate --config <file> --json``'s answer, computed here by the memory module."""
        from simpletuner.memory.autoconfig import DEFAULT_SAFETY_MARGIN
        from simpletuner.memory.estimated_config import read_estimated_config
        from simpletuner.memory.report import compute_estimate

        args = SimpleNamespace(
            config=str(checked.config_path),
            gpu="auto",
            gpu_memory=None,
            num_processes=self.processes or default_processes(),
            target_effective_batch=None,
            apply=False,
        )
        try:
            report = compute_estimate(args, DEFAULT_SAFETY_MARGIN, read_estimated_config(args.config, []))
        except (ValueError, RuntimeError, OSError) as exc:  # ConfigError is a ValueError
            checked.notes.append(f"no memory estimate: {exc}")
            return
        answer = json.loads(json.dumps(report.as_dict(), default=str))  # as `estimate --json` prints it
        checked.estimate_report = answer
        checked.estimate = answer.get("estimate")
        checked.estimate_text = report.lines()

    # --- the queue --------------------------------------------------------------------------------
    def submit(self, config_path: Path, resume: bool = False) -> Job:
        """Queue ``config_path`` (ConfigError when it does not load); it starts when nothing else runs and its
        output_dir is free."""
        config_path = Path(config_path).resolve()
        loaded = load_config(config_path, check_files=False)
        mixed = loaded.raw.get("mixed_precision") or loaded.config.mixed_precision
        job_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        job = Job(
            id=job_id,
            config_path=config_path,
            output_dir=Path(loaded.config.output_dir).resolve(),
            state="queued",
            resume=resume,
            pid=None,
            returncode=None,
            argv=launch_argv(config_path, str(mixed), self.processes or default_processes(), resume),
            log_path=self.workdir / "jobs" / f"{job_id}.log",
        )
        with self._lock:
            self._jobs.append(job)
        self._wake.set()
        return job

    def resume(self, run_path: Path) -> Job:
        """Submit the run's own ``config.json`` (the config as it ran) with resume_from_checkpoint=latest."""
        config = Path(run_path).resolve() / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{run_path} holds no config.json: not a run folder")
        return self.submit(config, resume=True)

    def jobs(self) -> list[Job]:
        """Every job of this queue, oldest first."""
        with self._lock:
            return list(self._jobs)

    def stop(self, run_path: Path) -> bool:
        """Stop the run in ``run_path``: a queued job of ours is dropped; a running one gets SIGTERM in its
        training processes (it saves a checkpoint and exits 143); a run we did not launch gets SIGTERM to its
        lock holder's pid when that is on this host. False when there is nothing to stop."""
        run_path = Path(run_path).resolve()
        with self._lock:
            for job in self._jobs:
                if job.output_dir != run_path or job.state not in ("queued", "running"):
                    continue
                if job.state == "queued":
                    job.state, job.ended, job.waiting_for = "stopped", time.time(), None
                    return True
                self._stopping.add(job.id)
                return self._terminate(self._procs[job.id])
        holder = runs.lock_holder(run_path)
        return holder is not None and holder.is_here and _signal(holder.pid)

    def _terminate(self, proc: subprocess.Popen) -> bool:
        """SIGTERM to the training processes under the launcher ``proc``: accelerate's single-process launcher
        has no SIGTERM handler (it would die at once, its child still saving, and its report of the child's
        exit code lost), and torchrun forwards a signal only to its workers anyway. Before a training process
        exists, the launcher's whole process group."""
        training = [pid for pid in _children(proc.pid) if _is_training(pid)]
        if training:
            return any([_signal(pid) for pid in training])
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        return True

    def shutdown(self) -> None:
        """Stop the scheduler thread (queued jobs stay queued; running ones keep running)."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)

    # --- the scheduler thread ---------------------------------------------------------------------
    def _schedule(self) -> None:
        while not self._closed:
            with self._lock:
                self._reap()
                if not any(job.state == "running" for job in self._jobs):
                    self._start_next()
            self._wake.wait(_POLL_S)
            self._wake.clear()

    def _reap(self) -> None:
        for job in self._jobs:
            if job.state != "running":
                continue
            proc = self._procs[job.id]
            code = proc.poll()
            if code is None:
                continue
            job.launcher_returncode, job.ended = code, time.time()
            job.returncode = _child_code(job.log_path, code)
            if code == 0:
                job.state = "done"
                if job.output_dir is not None and job.output_dir in self._demos:  # whichever copy of its config ran
                    demo_data.write_before_after(job.output_dir, prompt=demo_data.VALIDATION_PROMPT)
            elif job.id in self._stopping or job.returncode in _STOP_CODES:
                job.state = "stopped"
            else:
                job.state = "failed"
            del self._procs[job.id]

    def _start_next(self) -> None:
        queued = [job for job in self._jobs if job.state == "queued"]
        if not queued:
            return
        job = queued[0]  # in order: the head waits, and the rest behind it
        for later in queued[1:]:
            later.waiting_for = f"job {job.id}"
        holder = runs.lock_holder(job.output_dir) if job.output_dir is not None else None
        if holder is not None:
            job.waiting_for = f"output_dir {job.output_dir} is held by {holder.describe()}"
            return
        job.waiting_for = None
        with open(job.log_path, "ab") as log:
            try:
                proc = subprocess.Popen(
                    job.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            except OSError as exc:
                log.write(f"cannot start {job.argv[0]}: {exc}\n".encode())
                job.state, job.ended = "failed", time.time()
                return
        self._procs[job.id] = proc
        job.pid, job.state, job.started = proc.pid, "running", time.time()

    # --- the demo ---------------------------------------------------------------------------------
    def write_demo(self) -> Path:
        """The demo's tiny model, shapes dataset and config under ``workdir/demo``, with its output_dir a new
        folder under ``runs_root`` (``demo``, ``demo-2``, ...): 30 steps, a checkpoint and validation images
        every 10, metrics every step. Returns the config's path."""
        root = self.workdir / "demo"
        base = demo_data.write_demo(root, max_train_steps=DEMO_STEPS)
        config = orjson.loads(base.read_bytes())
        output = self.runs_root / "demo"
        number = 1
        while output.exists():
            number += 1
            output = self.runs_root / f"demo-{number}"
        config.update(
            output_dir=str(output),
            checkpointing_steps=DEMO_EVERY,
            checkpoints_total_limit=None,
            validation_steps=DEMO_EVERY,
            logging_steps=1,
        )
        path = root / f"config-{output.name}.json"
        path.write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2))
        output.mkdir(parents=True, exist_ok=True)  # taken: the next demo gets the next name
        self._demos.add(output)
        return path


def _read_object(path: Path) -> dict[str, Any]:
    """The config file's object, read as `simpletuner train` reads it (JSON, or an ai-toolkit YAML job)."""
    raw = read_config_file(path)
    if not isinstance(raw, dict):
        raise ConfigError(["the config must be a JSON object ({...})"], str(path))
    return raw


def _translate(raw: dict[str, Any], path: Path, notes: list[str]) -> tuple[str, dict[str, Any]]:
    """The dialect of ``raw`` and its native config, as the loader translates it; the translation's report
    (summary, defaults, ignored keys, approximations, forced settings) goes to ``notes``."""
    dialect, native, report = translate_dialect(raw, path)
    if report is not None:
        notes += report.lines(mapped=False)
        notes += [f"approximated: {line}" for line in report.approximated]
        notes += [f"forced: {line}" for line in report.overridden]
    return dialect, native


def _is_training(pid: int) -> bool:
    """Whether ``pid`` runs the trainer's entry file (not a compile worker or a resource tracker)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return os.fsencode(TRAIN_ENTRY) in argv


def _child_code(log_path: Path, code: int) -> int:
    """The training process's exit code where the launcher's log reports it (its last report), else ``code``."""
    if code == 0:
        return 0
    tail = "\n".join(runs.tail_lines(log_path))
    for pattern in _CHILD_CODE:
        found = pattern.findall(tail)
        if found:
            return int(found[-1])
    return code
