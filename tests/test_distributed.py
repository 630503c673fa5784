"""Two real processes on CPU (gloo DDP) through `accelerate launch`."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(config: Path, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()),
           str(ROOT / "simpletuner" / "train.py"), "--config", str(config), *extra]
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
def test_two_processes_shard_batches_and_only_rank0_writes(make_config, tmp_path):
    raw = make_config(max_train_steps=4, checkpointing_steps=2, train_batch_size=2)
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    proc = _launch(path, "--log-level", "DEBUG")
    assert proc.returncode == 0, proc.stderr[-4000:]

    # Each rank logs the sample keys of every micro-batch at DEBUG: the two ranks never share one.
    seen: dict[int, list[list[str]]] = {0: [], 1: []}
    for rank, keys in re.findall(r"rank (\d) micro-batch: (\[.*?\])", proc.stderr):
        seen[int(rank)].append(orjson.loads(keys.replace("'", '"')))
    assert len(seen[0]) == len(seen[1]) == 4
    for a, b in zip(seen[0], seen[1]):
        assert len(a) == len(b) == 2
        assert not set(a) & set(b), (a, b)

    out = Path(raw["output_dir"])
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    state = orjson.loads((out / "checkpoint-4" / "trainer_state.json").read_bytes())
    assert state["world_size"] == 2
    assert state["samples_seen"] == 4 * 2 * 2  # steps x batch x processes
    assert sorted(p.name for p in (out / "checkpoint-4").glob("rng_state_*.pt")) == ["rng_state_0.pt", "rng_state_1.pt"]
    assert not list(out.glob(".checkpoint-*"))

    # Resume with two processes continues to the new end.
    raw2 = dict(raw, max_train_steps=6, resume_from_checkpoint="latest")
    path.write_bytes(orjson.dumps(raw2))
    proc = _launch(path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr and "at step 4" in proc.stderr
    assert (out / "latest").read_text() == "checkpoint-6"
