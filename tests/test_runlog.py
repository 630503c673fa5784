"""A run you can follow: training.log and metrics.jsonl (appended across resumes), console logging levels."""

from __future__ import annotations

import io
import logging

import orjson
import pytest
from training_helpers import train

from simpletuner.configuration import validate_config
from simpletuner.state import StateTracker
from simpletuner.training.runlog import RunLog, configure_logging
from simpletuner.training.trainer import Trainer

#: What every metrics line carries on a CPU run (MFU and memory figures need a GPU or a known peak).
WINDOW_KEYS = {"step", "loss", "lr", "samples_per_s", "step_time_s", "data_wait_share", "tflops", "time"}


@pytest.fixture
def console():
    """The console as `simpletuner train` configures it (INFO), captured; logging restored after."""
    root, ours = logging.getLogger(), logging.getLogger("simpletuner")
    saved = root.level, list(root.handlers), ours.level
    stream = io.StringIO()
    configure_logging("INFO", stream=stream)
    yield stream
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    ours.setLevel(saved[2])


def _metrics(path):
    return [orjson.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_training_log_and_metrics_are_appended_across_a_resume(make_config, tmp_path, console):
    out = tmp_path / "run"
    common = dict(output_dir=str(out), checkpointing_steps=2, eval_steps=2, eval_iters=1, logging_steps=1)
    train(make_config(max_train_steps=4, **common))
    first_log = (out / "training.log").read_text(encoding="utf-8")
    first_metrics = (out / "metrics.jsonl").read_text(encoding="utf-8")
    assert "step 4/4" in first_log and "resumed from" not in first_log

    _, result = train(make_config(max_train_steps=6, resume_from_checkpoint="latest", **common))
    assert result.global_step == 6
    log = (out / "training.log").read_text(encoding="utf-8")
    # Appended, not truncated: the first run's lines, then the second run's.
    assert log.startswith(first_log)
    second = log[len(first_log) :]
    assert "resumed from" in second and "checkpoint-4" in second and "step 6/6" in second
    assert second.index("resumed from") < second.index("step 5/6") < second.index("step 6/6")
    # The same lines as the console, formatted the same way ("<time> INFO <logger>: <message>").
    assert log == console.getvalue()
    assert any(
        line.split(" ", 3)[2:3] == ["INFO"] and "simpletuner.training.trainer: step 1/4" in line
        for line in log.splitlines()
    )

    assert (out / "metrics.jsonl").read_text(encoding="utf-8").startswith(first_metrics)
    lines = _metrics(out / "metrics.jsonl")
    steps = [line["step"] for line in lines]
    assert steps == [1, 2, 3, 4, 5, 6]  # strictly increasing across the resume
    for line in lines:
        assert WINDOW_KEYS <= set(line), line
        assert line["loss"] > 0 and line["lr"] > 0 and 0 <= line["data_wait_share"] < 1 and line["tflops"] > 0
        assert ("eval_loss" in line) == (line["step"] % 2 == 0)
    times = [line["time"] for line in lines]
    assert times == sorted(times)


def test_debug_shows_our_debug_lines_not_third_party_noise(make_config, tmp_path, capsys):
    from simpletuner.cli.train import main

    root, ours = logging.getLogger(), logging.getLogger("simpletuner")
    saved = root.level, list(root.handlers), ours.level
    config = tmp_path / "cfg.json"
    config.write_bytes(orjson.dumps(make_config(max_train_steps=1)))
    try:
        assert main(["--config", str(config), "--log-level", "DEBUG"]) == 0
        logging.getLogger("PIL.PngImagePlugin").debug("STREAM b'IHDR' 16 13")  # as PIL logs a PNG chunk
        logging.getLogger("urllib3.connectionpool").debug("Starting new HTTPS connection")
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        ours.setLevel(saved[2])
    console = capsys.readouterr().err  # log lines share it with the progress bar: match records anywhere
    assert " DEBUG simpletuner.training.trainer: rank 0 micro-batch: " in console
    assert " PIL." not in console and "urllib3" not in console  # the run opened its PNGs while caching
    log = (tmp_path / "output" / "training.log").read_text(encoding="utf-8")
    assert " DEBUG simpletuner.training.trainer: rank 0 micro-batch: " in log and " PIL." not in log


def test_console_levels_for_ours_and_third_party():
    root, ours = logging.getLogger(), logging.getLogger("simpletuner")
    saved = root.level, list(root.handlers), ours.level
    try:
        stream = io.StringIO()
        configure_logging("DEBUG", stream=stream)
        configure_logging("DEBUG", stream=stream)  # a second run in the process: still one console handler
        logging.getLogger("simpletuner.x").debug("ours")
        logging.getLogger("PIL.PngImagePlugin").debug("chunk")
        logging.getLogger("filelock").info("third-party info")
        assert stream.getvalue().count("ours") == 1 and "chunk" not in stream.getvalue()
        assert "third-party info" in stream.getvalue()
        configure_logging("WARNING", stream=stream)
        logging.getLogger("simpletuner.x").info("quiet")
        logging.getLogger("filelock").info("quiet too")
        assert "quiet" not in stream.getvalue()
        with pytest.raises(ValueError, match="unknown log level"):
            configure_logging("LOUD")
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        ours.setLevel(saved[2])


def test_two_runs_in_one_process_neither_leak_nor_double_lines(make_config, tmp_path, console):
    baseline = list(logging.getLogger().handlers)
    # A trainer that is set up but never trained (a tool, a benchmark) leaves its log attached...
    idle = Trainer(StateTracker(validate_config(raw := make_config(output_dir=str(tmp_path / "idle"))), raw))
    idle.setup()
    train(make_config(max_train_steps=2, output_dir=str(tmp_path / "a")))
    train(make_config(max_train_steps=3, output_dir=str(tmp_path / "b")))
    assert logging.getLogger().handlers == baseline  # ...until the next run starts; runs remove their own
    a = (tmp_path / "a" / "training.log").read_text(encoding="utf-8")
    b = (tmp_path / "b" / "training.log").read_text(encoding="utf-8")
    assert a.count("step 1/2") == 1 and "step 1/3" not in a
    assert b.count("step 1/3") == 1 and "step 1/2" not in b
    assert "step 1/2" not in (tmp_path / "idle" / "training.log").read_text(encoding="utf-8")
    assert [m["step"] for m in _metrics(tmp_path / "b" / "metrics.jsonl")] == [1, 2, 3]


def test_lines_before_the_output_folder_is_known_are_kept(tmp_path, console):
    log = logging.getLogger("simpletuner.test")
    with RunLog() as run:
        log.info("precision in force: bf16 (from accelerate launch)")
        run.open(tmp_path, is_main_process=True)
        log.info("after")
        run.write_metrics(3, {"loss": float("nan"), "lr": 1e-4})
    text = (tmp_path / "training.log").read_text(encoding="utf-8")
    assert text.index("precision in force") < text.index("after")
    assert orjson.loads((tmp_path / "metrics.jsonl").read_bytes())["loss"] is None  # valid JSON, not NaN
    log.info("after the run")
    assert "after the run" not in (tmp_path / "training.log").read_text(encoding="utf-8")


def test_other_ranks_write_nothing(tmp_path, console):
    with RunLog() as run:
        logging.getLogger("simpletuner.test").info("held")
        run.open(tmp_path, is_main_process=False)
        run.write_metrics(1, {"loss": 1.0})
        assert run.log_path is None
    assert not (tmp_path / "training.log").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_a_stopped_run_says_why_in_training_log(tmp_path, console):
    with pytest.raises(RuntimeError):
        with RunLog() as run:
            run.open(tmp_path, is_main_process=True)
            raise RuntimeError("out of disk")
    last = (tmp_path / "training.log").read_text(encoding="utf-8").splitlines()[-1]
    assert " ERROR " in last and "run stopped: RuntimeError: out of disk" in last
