"""ui.runs on real run folders: one made by a real tiny training (in-process, through `simpletuner train`), and
hand-made ones for a stopped, a failed and a running run (a live process holding the output_dir lock)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from training_helpers import tiny_config

from simpletuner.locks import OUTPUT_LOCK_NAME
from simpletuner.testing.demo_data import VALIDATION_PROMPT, write_before_after
from simpletuner.ui import runs

STEPS = 4
STOPPED_LINE = (
    "2026-11-28 11:42:46,126 ERROR simpletuner.training.runlog: run stopped: Preempted: stopped by SIGTERM: saved "
    '/x/checkpoint-2; resume with resume_from_checkpoint: "latest"\n'
)
FAILED_LINE = (
    "2026-11-28 11:42:46,126 ERROR simpletuner.training.runlog: run stopped: NonFiniteLoss: non-finite loss in "
    "the window after step 2\n"
)


@pytest.fixture(scope="module")
def root(tiny_sd, shapes_dir, tmp_path_factory):
    """A runs root holding a finished tiny run (``team/finished``): 4 steps, checkpoints at 2 and 4,
    validation at 0 and 4, the before | after picture."""
    from simpletuner.cli import main

    base = tmp_path_factory.mktemp("ui_runs")
    out = base / "runs" / "team" / "finished"
    raw = tiny_config(
        tiny_sd,
        shapes_dir,
        base,
        output_dir=str(out),
        max_train_steps=STEPS,
        checkpointing_steps=2,
        validation_prompt=VALIDATION_PROMPT,
        validation_num_inference_steps=1,
        tracker_project_name="tiny",
    )
    config = base / "config.json"
    config.write_bytes(orjson.dumps(raw))
    assert main(["train", "--config", str(config)]) == 0
    assert write_before_after(out) is not None
    return base / "runs"


def _hand_made(root: Path, name: str, log_tail: str = "", records: int = 3) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_bytes(orjson.dumps({"model_family": "sdxl", "max_train_steps": 10}))
    lines = [
        {"step": s, "loss": 0.5 / s, "samples_per_s": 10.0, "step_time_s": 2.0, "mfu": 0.25, "time": 1e9 + s}
        for s in range(1, records + 1)
    ]
    (run / "metrics.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    (run / "training.log").write_text(
        "2026-11-28 11:40:00,000 INFO simpletuner.training.trainer: mixed precision bf16 in force, from the "
        "config\n" + log_tail
    )
    return run


def test_a_finished_run_reads_as_it_ran(root):
    found = {s.id: s for s in runs.find_runs(root)}
    summary = found["team/finished"]
    assert summary.state == "finished" and summary.step == STEPS and summary.total == STEPS
    assert summary.eta_s is None and summary.mfu is None  # no MFU on CPU: the trainer logs none
    assert summary.last_loss is not None and summary.samples_per_s is not None
    assert summary.model_family == "sd" and summary.config_name == "tiny"
    assert summary.started is not None and abs(summary.started - time.time()) < 3600
    assert runs.run_summary(root, "team/finished").to_json()["path"] == str(summary.path)

    records = runs.metrics(summary.path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {"loss", "lr", "samples_per_s", "data_wait_share"} <= set(records[-1])


def test_run_detail_lists_checkpoints_weights_validation_and_sources(root):
    detail = runs.run_detail(root, "team/finished")
    assert detail["summary"]["state"] == "finished"
    assert detail["config"]["max_train_steps"] == STEPS
    assert [(c["name"], c["step"]) for c in detail["checkpoints"]] == [("checkpoint-2", 2), ("checkpoint-4", 4)]
    files = {f["path"] for f in detail["checkpoints"][0]["files"]}
    assert "checkpoint-2/pytorch_lora_weights.safetensors" in files
    assert [w["path"] for w in detail["weights"]] == ["pytorch_lora_weights.safetensors"]
    assert all(w["bytes"] > 0 for w in detail["weights"])
    steps = {v["step"]: v for v in detail["validation"]}
    assert sorted(steps) == [0, STEPS]
    assert steps[0]["grid"] == "validation/step_000000_grid.png"
    assert steps[STEPS]["images"] == [f"validation/step_{STEPS:06d}_0.png"]
    assert detail["before_after"] == "before_after.png"
    assert any(line.startswith("mixed precision no in force") for line in detail["sources"])
    assert any("CPU threads" in line for line in detail["sources"])
    for rel in [detail["before_after"], steps[0]["grid"], detail["weights"][0]["path"]]:
        assert runs.resolve_file(root, "team/finished", rel).is_file()


def test_stopped_failed_and_running_states(root, tmp_path):
    other = tmp_path / "runs"
    stopped = _hand_made(other, "stopped", STOPPED_LINE)
    failed = _hand_made(other, "failed", FAILED_LINE)
    killed = _hand_made(other, "killed")  # ended without a word: killed
    running = _hand_made(other, "running")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom simpletuner.locks import hold_output_dir\n"
            f"lock = hold_output_dir({str(running)!r})\nprint('held', flush=True)\ntime.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        states = {s.id: s for s in runs.find_runs(other)}
        assert {k: s.state for k, s in states.items()} == {
            "stopped": "stopped",
            "failed": "failed",
            "killed": "failed",
            "running": "running",
        }
        live = states["running"]
        assert live.step == 3 and live.total == 10 and live.eta_s == pytest.approx(7 * 2.0)
        assert live.mfu == 0.25 and live.model_family == "sdxl"
        assert runs.lock_holder(running).pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
    # killed: its name is left in the lock file, but the process is gone
    assert (running / OUTPUT_LOCK_NAME).read_bytes() and runs.run_state(running) == "failed"
    assert runs.run_state(stopped) == "stopped" and runs.run_state(failed) == "failed"
    assert runs.run_state(killed) == "failed"
    assert runs.run_detail(other, "stopped")["sources"] == ["mixed precision bf16 in force, from the config"]


def test_sources_are_the_latest_launchs(tmp_path):
    """A resumed run's log says where its settings came from at each start: the page shows the last start's."""
    run = _hand_made(tmp_path, "resumed")
    said = [
        "mixed precision no in force, from `accelerate launch --mixed_precision no`; the config does not set it",
        "gradient_accumulation_steps 1, from /w/configs/demo.json",
        "mixed precision no in force, from /r/config.json, and `accelerate launch --mixed_precision no` agrees",
        "gradient_accumulation_steps 1, from /r/config.json",
    ]
    log = "".join(f"2026-11-28 12:05:0{i},253 INFO simpletuner.training.trainer: {m}\n" for i, m in enumerate(said))
    (run / "training.log").write_text(log)
    assert runs.sources(run) == said[2:]


def test_find_runs_skips_non_runs_and_depth(tmp_path):
    _hand_made(tmp_path, "a/b/c/d")  # depth 4: found
    _hand_made(tmp_path, "a/b/c/d2/e")  # depth 5: too deep
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "config.json").write_text("{}")  # a config alone is no run
    _hand_made(tmp_path, ".hidden/run")
    assert [s.id for s in runs.find_runs(tmp_path)] == ["a/b/c/d"]
    with pytest.raises(runs.UnknownRun):
        runs.run_summary(tmp_path, "input")
    with pytest.raises(runs.UnknownRun):
        runs.run_summary(tmp_path, "a/../a/b/c/d")
    with pytest.raises(runs.UnknownRun):
        runs.run_detail(tmp_path, "nope")


def test_read_new_returns_complete_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert runs.read_new(path, 0) == ([], 0)  # not there yet
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"st')
    lines, offset = runs.read_new(path, 0)
    assert lines == ['{"step": 1}', '{"step": 2}'] and offset == 24
    assert runs.read_new(path, offset) == ([], offset)  # the partial line waits
    with open(path, "ab") as file:
        file.write(b'ep": 3}\n')
    lines, offset = runs.read_new(path, offset)
    assert lines == ['{"step": 3}'] and offset == path.stat().st_size
    path.write_bytes(b"new\n")  # rewritten shorter: read from the start
    assert runs.read_new(path, offset) == (["new"], 4)
    assert runs.metrics(tmp_path) == []  # "new" is no JSON record


def test_resolve_file_keeps_to_the_run_folder(root, tmp_path):
    run = root / "team" / "finished"
    outside = root / "team" / "secret.txt"
    outside.write_text("secret")
    (run / "link_out").symlink_to(outside)
    (run / "dir_out").symlink_to(root.parent)
    (run / "link_in").symlink_to(run / "config.json")
    try:
        assert runs.resolve_file(root, "team/finished", "link_in") == run / "config.json"
        for rel in [
            "../secret.txt",
            "validation/../../secret.txt",
            str(outside),
            "/etc/passwd",
            "link_out",
            "dir_out/config.json",
            "",
            "a\x00b",
            "..\\secret.txt",
        ]:
            with pytest.raises(runs.FileOutsideRun):
                runs.resolve_file(root, "team/finished", rel)
        with pytest.raises(FileNotFoundError):
            runs.resolve_file(root, "team/finished", "nope.png")
        with pytest.raises(FileNotFoundError):
            runs.resolve_file(root, "team/finished", "validation")  # a folder is no file
        with pytest.raises(runs.UnknownRun):
            runs.resolve_file(root, "../runs/team/finished", "config.json")
        with pytest.raises(runs.UnknownRun):
            runs.resolve_file(root, str(run), "config.json")
    finally:
        for name in ("link_out", "dir_out", "link_in"):
            os.unlink(run / name)
        outside.unlink()


def test_a_summary_reads_only_the_end_of_a_long_metrics_file(tmp_path):
    """The runs page refreshes every summary every 2 s: a long run's metrics.jsonl is read from its end only."""
    run = _hand_made(tmp_path, "long", records=2000)  # ~180 KB, many times the tail read
    assert (run / "metrics.jsonl").stat().st_size > 20 * 8192
    recent = runs.recent_metrics(run)
    assert 5 < len(recent) < 200 and recent == runs.metrics(run)[-len(recent) :]
    summary = runs.run_summary(tmp_path, "long")
    assert summary.step == 2000 and summary.last_loss == 0.5 / 2000
