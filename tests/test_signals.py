"""SIGTERM / SIGINT in every phase of a real run: one line, exit 143 / 130, no traceback, and what
each phase promises to keep (the cache written so far, the final weights).

The signals are sent by the process itself at a chosen point (``SIMPLETUNER_FAULT=<point>:<SIGNAL>``,
simpletuner/faults.py), so no case races the run. Each phase is interrupted once, SIGTERM and SIGINT
alternating: in real processes of ``python simpletuner/train.py`` (started together; most of each is
importing) where only a process shows the outcome (threads at exit, ``os._exit``, a rerun of what is
left on disk), else through ``train.main`` in this process with the signal really delivered to it.
The handler's logic for both signals in every mode is checked in-process at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from safetensors.torch import load_file
from training_helpers import same_weights, tiny_config, train

from simpletuner.training.reliability import Interrupted, RunSignals, run_phase

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = "pytorch_lora_weights.safetensors"

#: case -> (config variant, SIMPLETUNER_FAULT, expected exit code). Real processes for what only a
#: process shows (threads at exit, os._exit); the rest run main() in this process (below).
CASES = {
    "cache_fill": ("plain", "cache:shard_written@1:SIGTERM", 143),  # after the first (latents) shard
    "final_save": ("plain", "phase:final_save:SIGINT", 130),
    "second_sigint": ("loop_validation", "validation:prompt@3:SIGINT,validation:prompt@4:SIGINT", 130),
}
IN_PROCESS = {
    "scan": ("plain", "dataset:scan@3:SIGINT", 130),
    "first_validation": ("validation", "validation:prompt@1:SIGTERM", 143),  # while the first image renders
    "final_validation": ("validation", "validation:prompt@2:SIGINT", 130),
}


def _raw(tiny_sd, shapes_dir, base: Path, name: str, variant: str, cache: str | None = None) -> dict:
    raw = tiny_config(tiny_sd, shapes_dir, base, output_dir=str(base / name))
    raw["cache_config"] = {"cache_dir": str(base / (cache or f"cache_{name}"))}
    if variant == "validation":
        raw.update(validation_prompt="a red circle", validation_num_inference_steps=1)
    if variant == "loop_validation":  # two prompts, rendered at step 0 and, inside the loop, at step 2
        raw.update(
            validation_prompts=["a red circle", "a blue square"], validation_steps=2, validation_num_inference_steps=1
        )
    return raw


@pytest.fixture(scope="module")
def runs(tiny_sd, shapes_dir, tmp_path_factory):
    """The real processes, started together, and meanwhile an undisturbed run in this process
    (its complete cache serves the in-process cases, and the real ones but the cache fill's: they find
    it filled while they import)."""
    base = tmp_path_factory.mktemp("signals")
    procs, raws = {}, {}
    for name, (variant, fault, _) in CASES.items():
        cache = None if name == "cache_fill" else "cache"  # the fill that is interrupted has a cache of its own
        raws[name] = raw = _raw(tiny_sd, shapes_dir, base, name, variant, cache=cache)
        config = base / f"{name}.json"
        config.write_bytes(orjson.dumps(raw))
        procs[name] = subprocess.Popen(
            [sys.executable, "simpletuner/train.py", "--config", str(config)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", SIMPLETUNER_FAULT=fault),
        )
    reference, _ = train(_raw(tiny_sd, shapes_dir, base, "reference", "plain", cache="cache"))
    results = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=240)  # a thread left running would hang here
        results[name] = (proc.returncode, err)
    return {
        "reference": load_file(reference.output_dir / WEIGHTS),
        "raws": raws,
        "results": results,
        "base": base,
        "model": (tiny_sd, shapes_dir),
    }


def _one_stop_line(code: int, err: str, expected: int) -> str:
    assert code == expected, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith(("stopped", "second"))]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def _stop_line(runs, name: str) -> str:
    return _one_stop_line(*runs["results"][name], CASES[name][2])


class _Unhandled(Exception):
    pass


@pytest.fixture
def guarded_signals():
    """While a case sends signals to this process: if the run's handlers were not in force, the
    signal fails the test instead of ending the test session."""

    def fail(signum, frame):
        raise _Unhandled(f"{signal.Signals(signum).name} reached the test process unhandled")

    previous = {sig: signal.signal(sig, fail) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize(
    "name, words",
    [
        ("scan", "stopped by SIGINT during the dataset scan: nothing trained yet, nothing to save"),
        (
            "first_validation",
            "stopped by SIGTERM during the first validation: nothing trained yet, nothing to save; "
            "the caches are complete",
        ),
        ("final_validation", "stopped by SIGINT during the final validation: the final weights are saved"),
    ],
)
def test_a_signal_outside_the_loop_stops_at_once_with_one_line(runs, name, words, monkeypatch, capsys, guarded_signals):
    from simpletuner.cli.train import main as train_main
    from simpletuner.faults import reset_fault_counts

    variant, fault, code = IN_PROCESS[name]
    raw = _raw(*runs["model"], runs["base"], name, variant, cache="cache")  # the reference's complete cache
    config = runs["base"] / f"{name}.json"
    config.write_bytes(orjson.dumps(raw))
    monkeypatch.setenv("SIMPLETUNER_FAULT", fault)
    reset_fault_counts()
    returned = train_main(["--config", str(config)])
    assert _one_stop_line(returned, capsys.readouterr().err, code).startswith(words)
    assert RunSignals.installed() is None  # the handlers are gone with the run
    out = Path(raw["output_dir"])
    if name == "final_validation":
        assert same_weights(load_file(out / WEIGHTS), runs["reference"])
    else:
        assert not list(out.glob("checkpoint-*")) and not (out / WEIGHTS).exists()


def test_sigterm_during_the_cache_fill_keeps_the_entries_and_the_rerun_reuses_them(runs):
    line = _stop_line(runs, "cache_fill")
    assert line == (
        "stopped by SIGTERM during the cache fill: nothing trained yet, nothing to save; the 12 cache "
        "entries written so far are kept and the next run reuses them"
    )
    raw = runs["raws"]["cache_fill"]
    cache = Path(raw["cache_config"]["cache_dir"])
    assert not list(cache.rglob(".tmp-*")), list(cache.rglob("*"))  # no half shard left to be taken for data
    rerun, _ = train(raw)
    latents, text = rerun.data.fill_reports["latents"], rerun.data.fill_reports["text"]
    assert (latents.num_hits, latents.num_computed) == (12, 0)  # the 12 written before the signal
    assert text.num_computed == 12  # the text cache had not been written
    assert same_weights(load_file(Path(raw["output_dir"]) / WEIGHTS), runs["reference"])


def test_sigint_during_the_final_save_completes_it_first(runs):
    line = _stop_line(runs, "final_save")
    out = Path(runs["raws"]["final_save"]["output_dir"])
    assert line == (
        f"stopped by SIGINT during the final save: the final weights were saved ({out / WEIGHTS}); "
        "the final validation is skipped"
    )
    assert same_weights(load_file(out / WEIGHTS), runs["reference"])  # whole, and the undisturbed run's
    assert (out / "latest").read_text() == "checkpoint-4"  # checkpoint_at_end, inside the save, completed too


def test_a_second_sigint_stops_at_once_without_saving(runs):
    assert _stop_line(runs, "second_sigint") == "second SIGINT: stopping now without saving"
    out = Path(runs["raws"]["second_sigint"]["output_dir"])
    assert not list(out.glob("checkpoint-*")) and not (out / WEIGHTS).exists()


# --- the handler itself, in this process: both signals in every mode ------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_each_mode_for_both_signals(sig):
    before = signal.getsignal(sig)
    with RunSignals() as signals:
        assert RunSignals.installed() is signals
        run_phase("model_load")
        with pytest.raises(Interrupted) as info:
            signal.raise_signal(sig)  # interrupt: raised where the main thread is
        assert info.value.exit_code == 128 + sig
        assert str(info.value).startswith(f"stopped by {sig.name} during the model load: nothing trained yet")
    assert signal.getsignal(sig) is before  # restored

    with RunSignals() as signals:
        with signals.flagged():
            signal.raise_signal(sig)  # flag: nothing raised, read at the step boundary
            assert signals.signum == sig
        with pytest.raises(Interrupted, match=f"stopped by {sig.name} during training: the final weights were saved"):
            with signals.deferred("final_save", kept=lambda: "the final weights were saved (here)"):
                pass  # a signal left pending by the loop's last step takes effect after the final save

    with RunSignals() as signals:
        finished = []
        with pytest.raises(Interrupted, match="during the final save"):
            with signals.deferred("final_save", kept=lambda: "saved"):
                signal.raise_signal(sig)
                finished.append(True)  # the save runs to its end
        assert finished == [True]
        if sig == signal.SIGTERM:  # a repeated SIGTERM (launcher + scheduler) does not abandon the stop
            signal.raise_signal(sig)


def test_nested_runs_share_one_set_of_handlers():
    with RunSignals() as outer:
        with RunSignals() as inner:
            assert inner is outer and RunSignals.installed() is outer
        assert RunSignals.installed() is outer  # the inner exit leaves them in force
    assert RunSignals.installed() is None


def test_fault_specs_parse_points_with_colons():
    from simpletuner.faults import parse_faults

    assert parse_faults("checkpoint:renamed@2") == [("checkpoint:renamed", 2, signal.SIGKILL)]
    assert parse_faults("cache:shard_written:SIGTERM, validation:prompt@3:SIGINT") == [
        ("cache:shard_written", 1, signal.SIGTERM),
        ("validation:prompt", 3, signal.SIGINT),
    ]
    with pytest.raises(ValueError, match="positive integer"):
        parse_faults("phase:training@x")
