"""The start-up timeline: phases from the command (or the launcher) to the first step, in training.log and
metrics.jsonl; and `simpletuner train` and a one-process `accelerate launch` train the same run."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from safetensors.torch import load_file

from simpletuner.startup import (
    StartupTimeline,
    process_started_seconds_ago,
    quiet_gc_while_importing,
    seconds_between_starts,
)

REPO = Path(__file__).resolve().parents[1]
#: The phases a `simpletuner train` run marks, in order, without resume_from_checkpoint ("resume" after
#: "optimizer") or validation prompts ("first_validation" before "first_step").
RUN_PHASES = [
    "interpreter",
    "config",
    "imports",
    "accelerator",
    "datasets",
    "caches",
    "model",
    "sampling",
    "optimizer",
    "first_step",
]


def test_marks_are_consecutive_spans_and_a_repeated_name_adds_up(monkeypatch):
    clock = iter([10.0, 10.5, 12.0, 12.25])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    timeline = StartupTimeline()
    assert timeline.mark("config") == 0.5
    timeline.mark("imports")
    timeline.mark("config")
    assert timeline.phases == {"config": 0.75, "imports": 1.5}
    assert timeline.total == 2.25
    assert timeline.line() == "config 0.75s, imports 1.50s"


def test_the_kernel_dates_a_process_and_the_launcher_phase_comes_first():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        age = process_started_seconds_ago(child.pid)
        assert age is not None and 0.4 <= age < 10
        # this process started before the child: the child's "launcher" time is the gap between the starts
        gap = seconds_between_starts(os.getpid(), child.pid)
        own = process_started_seconds_ago()
        assert gap is not None and own is not None and abs(gap - (own - age)) < 0.05
        timeline = StartupTimeline(since_process_start=True)
        timeline.launched_by(os.getpid())  # as if this process had launched itself: 0 s
        assert list(timeline.phases) == ["launcher", "interpreter"]
        assert timeline.phases["launcher"] == 0 and timeline.phases["interpreter"] >= own
    finally:
        child.kill()
        child.wait()
    assert process_started_seconds_ago(child.pid) is None  # gone: unknown, not an error


def test_imports_run_without_the_collector_and_what_they_made_is_frozen():
    assert gc.isenabled()
    before = gc.get_freeze_count()
    try:
        with quiet_gc_while_importing():
            assert not gc.isenabled()
            made = [[i] for i in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
        gc.disable()
        with quiet_gc_while_importing():
            pass
        assert not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.enable()
        gc.unfreeze()


def _startup_record(output_dir: Path) -> dict:
    records = [orjson.loads(line) for line in (output_dir / "metrics.jsonl").read_bytes().splitlines()]
    startup = [r for r in records if "startup_s" in r]
    assert len(startup) == 1 and startup[0] is records[0], records  # in the launch's first logging window
    return startup[0]


def _train(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(cwd / "hf")}
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_simpletuner_train_and_a_one_process_accelerate_launch_train_the_same_run_and_time_their_start(
    make_config, tmp_path
):
    """The cheaper line for one process gives the same weights and losses; both log every start-up phase."""
    runs = {}
    for name in ("plain", "launched"):
        output_dir = tmp_path / name
        config = tmp_path / f"{name}.json"
        config.write_text(json.dumps(make_config(max_train_steps=2, output_dir=str(output_dir))))
        if name == "plain":
            cmd = [sys.executable, "-m", "simpletuner.cli", "train", "--config", str(config)]
        else:
            launch = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no"]
            cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, "--dynamo_backend", "no"]
            cmd += [str(REPO / "simpletuner" / "train.py"), "--config", str(config)]
        _train(cmd, tmp_path)
        runs[name] = output_dir

    plain_dir, launched_dir = runs["plain"], runs["launched"]
    plain_weights = load_file(plain_dir / "pytorch_lora_weights.safetensors")
    launched_weights = load_file(launched_dir / "pytorch_lora_weights.safetensors")
    assert plain_weights.keys() == launched_weights.keys()
    assert all(plain_weights[k].equal(launched_weights[k]) for k in plain_weights)

    def losses(output_dir):
        lines = (output_dir / "metrics.jsonl").read_bytes().splitlines()
        return [orjson.loads(line)["loss"] for line in lines]

    assert losses(plain_dir) == losses(launched_dir)

    plain_record, launched_record = _startup_record(plain_dir), _startup_record(launched_dir)
    assert list(plain_record["startup_s"]) == RUN_PHASES
    assert list(launched_record["startup_s"]) == ["launcher", *RUN_PHASES]
    for record in (plain_record, launched_record):
        phases = record["startup_s"]
        assert all(seconds >= 0 for seconds in phases.values())
        assert phases["imports"] > 0.1  # torch at least: the config was read before it
        assert record["to_first_step_s"] == pytest.approx(sum(phases.values()), abs=0.01)
    assert launched_record["startup_s"]["launcher"] > 0.1  # the launcher's own python and imports
    for output_dir in runs.values():
        log = (output_dir / "training.log").read_text()
        assert "start-up: " in log
        first = next(line for line in log.splitlines() if "first step done" in line)
        assert "s after the command: " in first and "imports " in first and "first step " in first
