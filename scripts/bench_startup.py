"""Start-up: seconds from the command to the end of the first optimizer step, by phase, against a baseline commit.

Runs the real command, ``python -m simpletuner.cli train --config demo.json --set max_train_steps=1 ...``
(a fresh process each time, warm caches, the tiny SD demo), for this tree and for a baseline commit
(``git archive`` into a temporary folder), interleaved, and reports medians of:

- command -> end of first step, timed from outside (from the spawn to step 1's logging window: its time in
  ``metrics.jsonl``, or its ``training.log`` line for a tree from before the start-up record), the run's own
  figure for it (``to_first_step_s``), and command -> process exit;
- each start-up phase the run logs (``startup_s`` in the first window of ``metrics.jsonl``: launcher,
  interpreter, config, imports, accelerator, datasets, caches, model, sampling, optimizer, resume, first
  step; an older tree's ``start-up:`` line where it has no record);
- the floor: ``python -c "import torch, diffusers"``; and a refused config (an unknown key) answered by
  ``simpletuner train`` (exit 2);
- with ``--launcher``: the same run under ``accelerate launch --num_processes 1`` (this tree only).

    python scripts/bench_startup.py [--repeats 5] [--baseline REV] [--launcher]

``--baseline`` defaults to HEAD when ``simpletuner/`` has uncommitted changes, else HEAD~1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
RUN_ARGS = ["--set", "max_train_steps=1", "--set", "validation_prompt=null", "--set", "checkpointing_steps=null"]
FIRST_STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .* step 1/\d+ ")
STARTUP_LINE = re.compile(r"simpletuner\.training\.trainer: start-up: (.*)$", re.M)


def default_baseline() -> str:
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "simpletuner"]).returncode
    return "HEAD" if dirty else "HEAD~1"


def export_tree(rev: str, dest: Path) -> str:
    """``rev``'s files in ``dest``; returns its short hash."""
    short = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return short


def child_env(tree: Path) -> dict[str, str]:
    """The tree first on the path (ahead of the editable install's finder; children also run in ``tree``, as
    ``-m`` puts the working folder first), one CPU thread, offline."""
    extra = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(tree), extra) if p),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        HF_HUB_OFFLINE="1",
    )


def log_time(line_match: re.Match) -> float:
    """The Unix time of a training.log line (local time, millisecond precision)."""
    stamp = dt.datetime.strptime(line_match.group(1), "%Y-%m-%d %H:%M:%S")
    return time.mktime(stamp.timetuple()) + int(line_match.group(2)) / 1000


def parse_phases(text: str) -> dict[str, float]:
    """``accelerator 0.01s, datasets 0.00s`` -> {"accelerator": 0.01, ...}."""
    out = {}
    for part in text.split(", "):
        name, _, value = part.rpartition(" ")
        if value.endswith("s"):
            out[name.replace(" ", "_")] = float(value[:-1])
    return out


def one_run(command: list[str], tree: Path, output_dir: Path) -> dict[str, float]:
    """Spawn ``command``; the figures of its start-up (seconds)."""
    start = time.time()
    done = subprocess.run(command, env=child_env(tree), cwd=tree, capture_output=True, text=True)
    exited = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    figures: dict[str, float] = {}
    records = [orjson.loads(line) for line in (output_dir / "metrics.jsonl").read_bytes().splitlines()]
    startup = next((r for r in records if "startup_s" in r), None)
    if startup is not None:  # the launch's first logging window (step 1 here)
        first_step_at = startup["time"]
        figures.update(startup["startup_s"])
        figures["logged_to_first_step"] = startup["to_first_step_s"]
    else:  # a tree from before the start-up record: its log line's timestamps
        log = (output_dir / "training.log").read_text()
        step_line = next(m for m in map(FIRST_STEP_LINE.match, log.splitlines()) if m)
        first_step_at = log_time(step_line)
        phases = STARTUP_LINE.search(log)
        figures.update(parse_phases(phases.group(1)) if phases else {})
    figures["command_to_first_step"] = first_step_at - start
    figures["command_to_exit"] = exited - start
    return figures


def wall(command: list[str], tree: Path, expect: int) -> float:
    start = time.time()
    done = subprocess.run(command, env=child_env(tree), cwd=tree, capture_output=True, text=True)
    seconds = time.time() - start
    if done.returncode != expect:
        raise SystemExit(f"{' '.join(command)}: exit {done.returncode}, expected {expect}:\n{done.stderr[-2000:]}")
    return seconds


def train_command(config: Path, output_dir: Path, cache_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "simpletuner.cli",
        "train",
        "--config",
        str(config),
        *RUN_ARGS,
        "--set",
        f"output_dir={output_dir}",
        "--set",
        f"cache_config.cache_dir={cache_dir}",
        "--overwrite",
    ]


def launcher_command(config: Path, output_dir: Path, cache_dir: Path) -> list[str]:
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    flags = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    train = train_command(config, output_dir, cache_dir)[4:]  # the train arguments after `-m simpletuner.cli train`
    return [accelerate, "launch", *flags, "-m", "simpletuner.train", *train]


def median_row(runs: list[dict[str, float]], keys: list[str]) -> list[str]:
    return [f"{statistics.median(r[k] for r in runs):.2f}" if all(k in r for r in runs) else "-" for k in keys]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="the commit to compare with (default: see the module doc)")
    parser.add_argument("--launcher", action="store_true", help="also time `accelerate launch --num_processes 1`")
    args = parser.parse_args()
    baseline = args.baseline or default_baseline()
    sys.path.insert(0, str(ROOT))
    from simpletuner.testing.demo_data import write_demo

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        config = write_demo(tmp / "demo")
        base_tree = tmp / "baseline"
        base_hash = export_tree(baseline, base_tree)
        variants: dict[str, tuple[Path, object]] = {
            f"baseline {baseline} ({base_hash})": (base_tree, train_command),
            "this tree": (ROOT, train_command),
        }
        if args.launcher:
            variants["this tree, accelerate launch"] = (ROOT, launcher_command)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        floor, refused = [], []
        bad = tmp / "bad.json"
        bad.write_bytes(orjson.dumps({**orjson.loads(config.read_bytes()), "learning_rat": 1e-4}))
        for i in range(args.repeats + 1):  # the first round fills each tree's caches and is not counted
            for n, (name, (tree, make)) in enumerate(variants.items()):
                out, cache = tmp / f"out{n}", tmp / f"cache{n}"
                figures = one_run(make(config, out, cache), tree, out)  # type: ignore[operator]
                if i:
                    results[name].append(figures)
            if i:
                floor.append(wall([sys.executable, "-c", "import torch, diffusers"], ROOT, 0))
                refused.append(wall([sys.executable, "-m", "simpletuner.cli", "train", "--config", str(bad)], ROOT, 2))
    keys = ["command_to_first_step", "command_to_exit"]
    keys += [k for runs in results.values() for r in runs for k in r if k not in keys]
    keys = list(dict.fromkeys(keys))
    print(f"start-up, tiny SD demo, warm caches: median of {args.repeats} fresh processes each, seconds")
    print("| variant | " + " | ".join(k.replace("_", " ") for k in keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, runs in results.items():
        print(f"| {name} | " + " | ".join(median_row(runs, keys)) + " |")
    floor_s, refused_s = statistics.median(floor), statistics.median(refused)
    print(f'\n`python -c "import torch, diffusers"`: {floor_s:.2f} s')
    print(f"a refused config (an unknown key), `simpletuner train`: {refused_s:.2f} s")
    for name, runs in results.items():
        beyond = statistics.median(r["command_to_first_step"] for r in runs) - floor_s
        print(f"{name}: command -> end of first step {beyond:.2f} s beyond the import floor")
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}"
    print(f"machine: {machine}, load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
