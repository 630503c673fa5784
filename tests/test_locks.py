"""Locks and places: one run per output_dir, many readers and one writer per cache folder,
`cache clear` kept away from a running run, and no output or cache folder inside the data."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
from safetensors.torch import load_file
from training_helpers import same_weights, train

from simpletuner import locks
from simpletuner.caching import ShardedTensorStore
from simpletuner.caching import fill as cache_fill
from simpletuner.cli import cache as cache_command
from simpletuner.configuration import ConfigError, validate_config
from simpletuner.state import StateTracker
from simpletuner.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")

_HOLD = """
import sys, time
from simpletuner import locks
kind, folder = sys.argv[1], sys.argv[2]
if kind == "output":
    held = locks.hold_output_dir(folder)
else:
    held = locks.CacheLocks(folder).use()
    held.__enter__()
print("held", flush=True)
time.sleep(120)
"""


def _holder(kind: str, folder: Path) -> subprocess.Popen:
    """A child process that holds a lock until killed; returns once it holds it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, kind, str(folder)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "held\n", proc.stderr.read()
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()


# --- locks.py in real processes ----------------------------------------------------------------
def test_a_held_folder_names_its_holder_and_a_dead_holders_lock_is_taken_over(make_config, tmp_path, caplog):
    folder = tmp_path / "out"
    child = _holder("output", folder)
    try:
        with pytest.raises(locks.FolderLocked) as refused:
            locks.hold_output_dir(folder)
        message = str(refused.value)
        assert f"pid {child.pid} on host {socket.gethostname()}, started 20" in message
        assert "another output_dir" in message and str(folder) in message

        # --overwrite asks to remove an earlier run's results, never a live run's: the lock comes first.
        (folder / "checkpoint-1").mkdir()
        (folder / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
        raw = make_config(output_dir=str(folder))
        with pytest.raises(locks.FolderLocked, match=f"pid {child.pid}"):
            Trainer(StateTracker(validate_config(raw), raw), overwrite=True).train()
        assert (folder / "checkpoint-1").is_dir() and (folder / "pytorch_lora_weights.safetensors").is_file()
    finally:
        _kill(child)  # kill -9: no chance to release; the kernel drops its flock, its name stays in the file
    assert locks.Holder.parse((folder / locks.OUTPUT_LOCK_NAME).read_bytes()).pid == child.pid
    with caplog.at_level(logging.WARNING, logger="simpletuner.locks"):
        lock = locks.hold_output_dir(folder)
    assert lock.took_over.pid == child.pid
    assert f"took over the lock {folder / locks.OUTPUT_LOCK_NAME} from pid {child.pid}" in caplog.text
    assert locks.Holder.parse((folder / locks.OUTPUT_LOCK_NAME).read_bytes()).pid == os.getpid()
    lock.release()
    assert (folder / locks.OUTPUT_LOCK_NAME).read_bytes() == b""  # emptied, kept
    from simpletuner.training.run_folder import clear_previous_run

    clear_previous_run(folder)  # what --overwrite removes
    assert (folder / locks.OUTPUT_LOCK_NAME).is_file() and not (folder / "checkpoint-1").exists()
    locks.hold_output_dir(folder).release()  # free again, no takeover this time
    assert "took over" not in caplog.text.split(f"pid {child.pid}")[-1]


def test_cache_users_share_and_clear_refuses_or_waits_for_them(tmp_path):
    base = tmp_path / "cache" / "sd"
    cache = locks.CacheLocks(base)
    child = _holder("cache", base)
    try:
        with cache.use():  # a second reader is welcome
            assert {h.pid for h in cache.users()} == {child.pid, os.getpid()}
        dead = base / locks.CACHE_USERS_FOLDER / f"{socket.gethostname()}-999999999-0.json"
        dead.write_bytes(locks.Holder(999999999, socket.gethostname(), "2020-01-01T00:00:00+00:00").to_json())
        with pytest.raises(locks.FolderLocked) as refused:
            with cache.clearing():
                pass
        assert f"pid {child.pid}" in str(refused.value) and "--wait" in str(refused.value)
        assert "999999999" not in str(refused.value) and not dead.exists()  # a dead run's record is dropped

        said, done = [], threading.Event()

        def clear_waiting():
            with cache.clearing(wait=True, say=said.append):
                done.set()

        waiter = threading.Thread(target=clear_waiting)
        waiter.start()
        time.sleep(0.3)
        assert not done.is_set() and len(said) == 1 and f"pid {child.pid}" in said[0]
    finally:
        _kill(child)
    waiter.join(timeout=10)
    assert done.is_set() and len(said) == 1


def test_a_run_waiting_for_a_clear_that_deletes_the_lock_files_locks_the_new_ones(tmp_path):
    base = tmp_path / "cache" / "sd"
    cache = locks.CacheLocks(base)
    said, holding, done = [], threading.Event(), threading.Event()

    def run():
        with cache.use(say=said.append):
            holding.set()
            done.wait(10)

    with cache.clearing():
        starting = threading.Thread(target=run)
        starting.start()
        for _ in range(200):  # until it says it waits
            if said:
                break
            time.sleep(0.01)
        assert not holding.is_set() and f"cache clear` (pid {os.getpid()}" in said[0]
        assert cache.remove_if_empty() and not base.exists()  # the clear removed the cache, locks and all
    assert holding.wait(10)
    with pytest.raises(locks.FolderLocked):  # the run holds the new lock file, not the deleted one
        with cache.clearing():
            pass
    done.set()
    starting.join(timeout=10)


# --- the places rule ---------------------------------------------------------------------------
@pytest.mark.parametrize("inside", ["output_dir", "data"])
def test_output_dir_and_dataset_folder_may_not_hold_each_other(make_config, tmp_path, inside):
    data, out = tmp_path / "data", tmp_path / "data" / "out"
    if inside == "data":
        data, out = tmp_path / "out" / "data", tmp_path / "out"
    data.mkdir(parents=True)
    (data / "a.png").write_bytes(b"")
    raw = make_config(output_dir=str(out), datasets=[{"id": "d", "type": "local", "instance_data_dir": str(data)}])
    with pytest.raises(ConfigError) as refused:
        validate_config(raw, check_files=False)
    message = str(refused.value)
    assert str(out) in message and str(data) in message and "datasets[0].instance_data_dir" in message
    if inside == "output_dir":
        assert "is inside datasets[0]" in message and "next run would train on them" in message
    else:
        assert "is inside output_dir" in message


def test_cache_dir_in_the_data_is_refused_and_relative_paths_resolve_from_the_config(make_config, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    raw = make_config(
        cache_config={"cache_dir": "data/cache"}, datasets=[{"id": "d", "type": "local", "instance_data_dir": "data"}]
    )
    with pytest.raises(ConfigError) as refused:
        validate_config(raw, base_dir=tmp_path, check_files=False)
    expected = f"cache_config.cache_dir {data / 'cache'} is inside datasets[0].instance_data_dir {data}"
    assert expected in str(refused.value)
    validate_config(make_config(), check_files=False)  # the usual layout passes


def test_a_dataset_at_a_url_overlaps_no_run_folder(make_config, tmp_path, monkeypatch):
    """An object store or Hub dataset is not a folder here: output_dir "." (the working directory) is fine."""
    monkeypatch.chdir(tmp_path)
    for dataset in (
        {"id": "s3", "type": "object_store", "instance_data_dir": "s3://bucket/images"},
        {"id": "hub", "type": "huggingface", "dataset_name": "org/pictures"},
    ):
        raw = make_config(output_dir=".", cache_config={"cache_dir": "cache"}, datasets=[dataset])
        validate_config(raw, base_dir=tmp_path, check_files=False)


# --- real runs --------------------------------------------------------------------------------
def _write(raw: dict, path: Path) -> str:
    path.write_bytes(orjson.dumps(raw))
    return str(path)


def _launch(config: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "simpletuner/train.py", "--config", config],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_line(proc: subprocess.Popen, text: str, seen: list[str]) -> None:
    for line in proc.stderr:
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"the run ended without printing {text!r}:\n" + "".join(seen[-30:]))


def test_concurrent_launches_one_output_dir_refused_one_cache_filled_once(make_config, tmp_path):
    """Run A and run B share one (empty) cache folder; a test-held writer lock keeps both waiting
    to fill it, so both are provably running when run C starts into A's output_dir."""
    base = tmp_path / "cache" / "sd"
    raw_a = make_config(max_train_steps=3, output_dir=str(tmp_path / "a"))
    cfg_a = _write(raw_a, tmp_path / "a.json")
    cfg_b = _write(make_config(max_train_steps=3, output_dir=str(tmp_path / "b")), tmp_path / "b.json")
    with locks.CacheLocks(base).writing() as waited:
        assert not waited
        run_a, run_b = _launch(cfg_a), _launch(cfg_b)
        seen_a, seen_b = [], []
        _wait_for_line(run_a, "to finish filling the cache", seen_a)  # A holds output_dir a and waits to fill
        assert f"pid {os.getpid()}" in seen_a[-1]  # names who fills (here: the test)
        holder = locks.Holder.parse((tmp_path / "a" / locks.OUTPUT_LOCK_NAME).read_bytes())
        assert holder.pid == run_a.pid

        run_c = _launch(cfg_a)  # into A's output_dir, while A provably runs
        _wait_for_line(run_b, "to finish filling the cache", seen_b)
        err_c = run_c.communicate(timeout=60)[1]
        assert run_c.returncode == 2, err_c[-3000:]
        assert f"pid {run_a.pid} on host {socket.gethostname()}, started {holder.started}" in err_c
        assert "Traceback" not in err_c and err_c.count("error: output_dir") == 1
        assert run_a.poll() is None  # A is still waiting: C stopped at once, before anything loaded
    # The test's fill "ended" without writing: A and B now fill one after the other. Meanwhile the
    # same run trains undisturbed in this process (its own cache and output_dir): the reference.
    _, solo = train(
        make_config(
            max_train_steps=3,
            output_dir=str(tmp_path / "solo"),
            cache_config={"cache_dir": str(tmp_path / "solo_cache")},
        )
    )
    out_a, err_a = run_a.communicate(timeout=120)
    out_b, err_b = run_b.communicate(timeout=120)
    assert run_a.returncode == 0, err_a[-3000:]
    assert run_b.returncode == 0, err_b[-3000:]

    for name, needed in (("vae", 12), ("text", None)):
        shards = ShardedTensorStore(base / name).shard_entries()
        keys = [key for held in shards.values() for key in held]
        assert len(keys) == len(set(keys)), f"{name}: an entry was encoded twice"
        assert needed is None or len(keys) == needed
    assert ShardedTensorStore(base / "vae").verify().problems == {}

    weights_a, weights_solo = load_file(tmp_path / "a" / solo.output_path.name), load_file(solo.output_path)
    assert same_weights(weights_a, weights_solo)
    assert (tmp_path / "a" / locks.OUTPUT_LOCK_NAME).read_bytes() == b""  # released at the end


def test_cache_clear_during_a_fill_refuses_and_wait_clears_after_the_run(make_config, tmp_path, monkeypatch, capsys):
    raw = make_config(max_train_steps=2)
    cfg = _write(raw, tmp_path / "cfg.json")
    base = tmp_path / "cache" / "sd"
    during: dict = {}
    ended: list[float] = []

    def clear_waiting():
        during["wait_code"] = cache_command.main(["clear", "--config", cfg, "--yes", "--wait"])
        during["wait_done"] = time.monotonic()

    encode = cache_fill.encode_loaded

    def encode_and_clear(*args):
        if "code" not in during:  # the first VAE batch of the fill
            during["code"] = cache_command.main(["clear", "--config", cfg, "--yes"])
            during["err"] = capsys.readouterr().err
            during["waiter"] = threading.Thread(target=clear_waiting)
            during["waiter"].start()
        return encode(*args)

    monkeypatch.setattr(cache_fill, "encode_loaded", encode_and_clear)
    _, result = train(raw)
    ended.append(time.monotonic())
    assert result.global_step == 2
    during["waiter"].join(timeout=30)
    assert during["code"] == 2
    assert f"is used by a run: pid {os.getpid()} on host {socket.gethostname()}" in during["err"]
    assert "--wait" in during["err"] and "Traceback" not in during["err"]
    assert during["wait_code"] == 0 and during["wait_done"] >= ended[0]
    out = capsys.readouterr().out
    assert out.count("waiting for the run(s) that use the cache") == 1 and "removed 2 cache folder(s)" in out
    assert not base.exists()
