"""ui.jobs for real: configs checked by the loader (native, wrong, an ai-toolkit job) with the memory estimate;
tiny runs launched through `accelerate launch` (one process), one after the other, a job waiting for an
output_dir another process holds, a run stopped (SIGTERM: a checkpoint, exit 143) and resumed to its end."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import yaml
from training_helpers import tiny_config

from simpletuner.ui import jobs as ui_jobs
from simpletuner.ui import runs

PUBLISHED = Path(__file__).parent / "data" / "ai_toolkit_examples"


@pytest.fixture(scope="module")
def queue(tmp_path_factory):
    base = tmp_path_factory.mktemp("ui_jobs")
    q = ui_jobs.JobQueue(base / "work", base / "runs", processes=1)
    yield q
    q.shutdown()


def _wait(predicate, timeout: float = 120.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _config(queue, raw: dict, name: str) -> Path:
    checked = queue.check(json.dumps(raw), f"{name}.json", estimate=False)
    assert checked.ok, checked.problems
    return checked.config_path


def _hold(folder: Path) -> subprocess.Popen:
    """Another process holding ``folder``'s output_dir lock until it is ended."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom simpletuner.locks import hold_output_dir\n"
            f"lock = hold_output_dir({str(folder)!r})\nprint('held', flush=True)\ntime.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_check_lists_every_problem_and_estimates(queue, make_config):
    good = queue.check(json.dumps(make_config()), "good.json")
    assert good.ok and good.problems == [] and good.dialect == "native"
    assert good.config_path is not None and good.config_path.parent == queue.workdir / "configs"
    assert good.output_dir == Path(make_config()["output_dir"]).resolve()
    assert good.estimate is not None and good.estimate["model_family"] == "sd" and good.estimate["total"] > 0
    assert good.estimate_report is not None and good.estimate_report["total_bytes"] > 0
    assert any(line.startswith("total") for line in "\n".join(good.estimate_text).splitlines())

    bad = queue.check(json.dumps(make_config(lerning_rate=1, train_batch_size=0, resolution="big")), "../bad.json")
    assert not bad.ok and bad.estimate is None
    assert bad.config_path is not None and bad.config_path.parent == queue.workdir / "configs"  # no '..' escape
    text = "\n".join(bad.problems)
    assert "did you mean 'learning_rate'" in text and "train_batch_size" in text and "resolution" in text
    assert len(bad.problems) >= 3  # one pass: every problem at once

    broken = queue.check("{not json", "broken.json")
    assert not broken.ok and "is not valid JSON" in broken.problems[0]


def test_check_reads_an_ai_toolkit_job(queue, shapes_dir, tmp_path):
    from simpletuner.testing.zoo import write_tiny_model

    raw = json.loads((PUBLISHED / "train_lora_flux_24gb.json").read_text())
    process = raw["config"]["process"][0]
    process["model"]["name_or_path"] = str(write_tiny_model("flux", tmp_path / "flux"))
    for dataset in process["datasets"]:
        dataset.update(folder_path=str(shapes_dir), resolution=64)
    process["sample"].update(width=64, height=64)
    checked = queue.check(yaml.safe_dump(raw), "job.yaml", estimate=False)
    assert checked.dialect == "ai-toolkit" and checked.ok, checked.problems
    assert checked.config_path is not None and checked.config_path.suffix == ".yaml"
    assert checked.notes and checked.notes[0].startswith("read as an ai-toolkit job")


def test_runs_queue_in_order_wait_for_a_held_lock_stop_and_resume(queue, tiny_sd, shapes_dir, tmp_path):
    """A (3 steps) waits for its output_dir's lock, then runs; B waits for A, is stopped mid-run (a checkpoint,
    exit 143) and resumed to its end. A run we did not launch is stopped through its lock holder."""
    runs_root = queue.runs_root
    out_a, out_b = runs_root / "a", runs_root / "b"
    config_a = _config(queue, tiny_config(tiny_sd, shapes_dir, tmp_path, output_dir=str(out_a), max_train_steps=3), "a")
    raw_b = tiny_config(tiny_sd, shapes_dir, tmp_path, output_dir=str(out_b), max_train_steps=40)
    config_b = _config(queue, raw_b, "b")

    holder = _hold(out_a)
    job_a = queue.submit(config_a)
    job_b = queue.submit(config_b)
    assert job_a.argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert job_a.argv[job_a.argv.index("--config") - 1] == str(ui_jobs.TRAIN_ENTRY)
    assert job_a.argv[job_a.argv.index("--num_processes") + 1] == "1" and "--mixed_precision" in job_a.argv
    _wait(lambda: job_a.waiting_for is not None, 10, "A to see the held lock")
    time.sleep(1.0)
    assert (job_a.state, job_b.state) == ("queued", "queued") and str(holder.pid) in (job_a.waiting_for or "")
    # a run we did not launch is stopped through its lock holder
    other = _hold(runs_root / "other")
    assert queue.stop(runs_root / "other") is True
    assert other.wait(timeout=10) == -15
    assert queue.stop(runs_root / "nothing-there") is False
    holder.terminate()  # the lock is free: A starts
    holder.wait(timeout=10)

    _wait(lambda: job_a.state not in ("queued", "running"), 120, "A to end")
    assert (job_a.state, job_a.returncode) == ("done", 0), job_a.log_path.read_text()[-3000:]
    assert runs.run_state(out_a) == "finished"

    # B started only once A had ended
    _wait(lambda: job_b.state != "queued", 10, "B to start")
    assert job_b.started is not None and job_a.ended is not None and job_b.started >= job_a.ended
    _wait(lambda: bool(runs.metrics(out_b)) or job_b.state != "running", 120, "B's first step")
    assert queue.stop(out_b) is True
    _wait(lambda: job_b.state != "running", 60, "B to stop")
    log = job_b.log_path.read_text()
    assert (job_b.state, job_b.returncode) == ("stopped", 143), log[-3000:]
    assert "stopped by SIGTERM" in log
    step = runs.run_summary(runs_root, "b").step
    assert runs.run_state(out_b) == "stopped" and step is not None and step < 40
    assert (out_b / f"checkpoint-{step}" / "COMPLETE").is_file()

    job_c = queue.resume(out_b)
    assert job_c.resume and job_c.argv[-2:] == ["--set", "resume_from_checkpoint=latest"]
    assert job_c.config_path == out_b / "config.json"
    _wait(lambda: job_c.state not in ("queued", "running"), 120, "the resumed B to end")
    assert (job_c.state, job_c.returncode) == ("done", 0), job_c.log_path.read_text()[-3000:]
    assert f"resumed from {out_b / f'checkpoint-{step}'}" in (out_b / "training.log").read_text()
    assert orjson.loads((out_b / "final_weights.json").read_bytes())["step"] == 40
    assert runs.run_summary(runs_root, "b").state == "finished"
    assert [j.id for j in queue.jobs()][-2:] == [job_b.id, job_c.id]
    assert job_c.to_json()["config_path"] == str(out_b / "config.json")
    # never two at once
    spans = [(j.started, j.ended) for j in queue.jobs() if j.started is not None]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_write_demo_runs_under_the_runs_root(queue):
    first, second = queue.write_demo(), queue.write_demo()
    raw = orjson.loads(first.read_bytes())
    assert Path(raw["output_dir"]) == queue.runs_root / "demo"
    assert Path(orjson.loads(second.read_bytes())["output_dir"]) == queue.runs_root / "demo-2"
    assert (raw["max_train_steps"], raw["checkpointing_steps"], raw["validation_steps"]) == (30, 10, 10)
    checked = queue.check(first.read_text(), first.name, estimate=False)
    assert checked.ok, checked.problems
