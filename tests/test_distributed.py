"""Two real processes on CPU (gloo DDP) through `accelerate launch`.

Each launch starts three interpreters, so the launches are few: one uninterrupted run, shared by the
module, serves the sharding checks and is the reference the SIGTERM case resumes to; that case's
resume is the two-process resume check.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from training_helpers import same_weights, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_cmd(config: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        str(ROOT / "simpletuner" / "train.py"),
        "--config",
        str(config),
        *extra,
    ]


ENV = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def _launch(config: Path, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        _launch_cmd(config, *extra), capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT
    )


def _write(raw: dict, path: Path) -> Path:
    path.write_bytes(orjson.dumps(raw))
    return path


#: Steps of the shared two-process run: long enough that a SIGTERM sent at step 3 lands well before the end.
STEPS = 30


@pytest.fixture(scope="module")
def straight(tiny_sd, shapes_dir, tmp_path_factory):
    """One uninterrupted two-process run of STEPS steps (checkpoints every 4, DEBUG log), launched
    once for the module: ``(raw config, finished process)``. Read only."""
    root = tmp_path_factory.mktemp("distributed")
    raw = tiny_config(tiny_sd, shapes_dir, root, max_train_steps=STEPS, checkpointing_steps=4, train_batch_size=2)
    proc = _launch(_write(raw, root / "straight.json"), "--log-level", "DEBUG")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return raw, proc


@pytest.mark.slow
def test_two_processes_shard_batches_and_only_rank0_writes(straight):
    raw, proc = straight
    # Each rank logs the sample keys of every micro-batch at DEBUG: the two ranks never share one.
    seen: dict[int, list[list[str]]] = {0: [], 1: []}
    for rank, keys in re.findall(r"rank (\d) micro-batch: (\[.*?\])", proc.stderr):
        seen[int(rank)].append(orjson.loads(keys.replace("'", '"')))
    assert len(seen[0]) == len(seen[1]) == STEPS
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


@pytest.mark.slow
def test_two_processes_fill_the_cache_together(straight):
    """Each rank encoded its own part of the latents and captions into shards of its own; both
    report every entry (they indexed each other's shards), and no entry was encoded twice. The parts
    are whole encode batches: the 12 latents are 3 batches (one per bucket), split 2 + 1; the 12
    captions are one batch of up to 32, encoded by one rank."""
    raw, proc = straight
    reports = re.findall(r"(vae|text) cache: (\d+) items, 0 hits, (\d+) computed", proc.stderr)
    for name in ("vae", "text"):
        counts = [(int(items), int(done)) for kind, items, done in reports if kind == name]
        assert len(counts) == 2 and counts[0] == counts[1] and counts[0][0] == counts[0][1], reports
        folder = next(Path(raw["cache_config"]["cache_dir"]).glob(f"*/{name}"))
        writers = []
        for shard in folder.glob("shard-*.safetensors"):
            with safe_open(str(shard), "pt") as handle:
                writers.append({tensor.split("|")[0] for tensor in handle.keys()})
        # one shard per rank that got a batch (each holds under 256 entries)
        assert len(writers) == (2 if name == "vae" else 1), writers
        assert sum(len(w) for w in writers) == len(set().union(*writers)) == counts[0][0]  # each entry once


@pytest.mark.slow
def test_two_process_resume_continues_to_a_higher_max_train_steps(straight, tmp_path):
    """A finished two-process run, resumed with a higher max_train_steps, continues from its last
    checkpoint to the new end (on a copy: the shared run stays as it is)."""
    raw, _ = straight
    out = tmp_path / "output"
    shutil.copytree(raw["output_dir"], out)
    more = dict(raw, output_dir=str(out), max_train_steps=STEPS + 2, resume_from_checkpoint="latest")
    proc = _launch(_write(more, tmp_path / "more.json"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {out / f'checkpoint-{STEPS}'} at step {STEPS}" in proc.stderr
    assert (out / "latest").read_text() == f"checkpoint-{STEPS + 2}"


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def _rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the training processes under an `accelerate launch` (read from /proc)."""
    found = {}
    stack = [launcher]
    while stack:
        pid = stack.pop()
        for kid in _children(pid):
            env = Path(f"/proc/{kid}/environ").read_bytes().split(b"\0")
            rank = [e for e in env if e.startswith(b"RANK=")]
            if rank and b"train.py" in Path(f"/proc/{kid}/cmdline").read_bytes():
                found[int(rank[0][5:])] = kid
            stack.append(kid)
    return found


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_at_the_same_step_and_resumes_exactly(straight, make_config, tmp_path):
    """All ranks agree on a preemption at a step boundary, save together, and the two-process resume
    continues to the end, matching the uninterrupted two-process run bit for bit."""
    straight_raw, _ = straight
    raw = make_config(max_train_steps=STEPS, output_dir=str(tmp_path / "run"), logging_steps=1)
    cfg = _write(raw, tmp_path / "run.json")
    proc = subprocess.Popen(
        _launch_cmd(cfg), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    for line in proc.stderr:
        if "step 3/" in line:
            pids = _rank_pids(proc.pid)
            assert sorted(pids) == [0, 1], pids
            os.kill(pids[1], signal.SIGTERM)  # only rank 1 is told
            break
    err = proc.stderr.read()
    proc.wait(timeout=180)
    assert err.count("stopped by SIGTERM") == 2, err[-4000:]  # both ranks stopped, with the signal's reason
    out = Path(raw["output_dir"])
    latest = (out / "latest").read_text()
    assert sorted(p.name for p in out.glob("checkpoint-*/rng_state_*.pt")) == ["rng_state_0.pt", "rng_state_1.pt"]

    _write(dict(raw, resume_from_checkpoint="latest"), cfg)
    resumed = _launch(cfg)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {out / latest} at step {int(latest.split('-')[1])}" in resumed.stderr
    assert (out / "latest").read_text() == f"checkpoint-{STEPS}"  # checkpoint_at_end: the new end
    want = load_file(Path(straight_raw["output_dir"]) / "pytorch_lora_weights.safetensors")
    got = load_file(out / "pytorch_lora_weights.safetensors")
    assert same_weights(want, got)


@pytest.mark.slow
def test_two_processes_train_both_wan22_experts(make_config, tmp_path):
    """DDP with two experts: a micro-batch whose samples all sit on one side of the boundary
    leaves the other expert without gradients, which DDP accepts only when told to look for
    unused parameters (batch size 1: every micro-batch reaches exactly one expert); both adapters
    come out."""
    from simpletuner.models.wan22 import LORA_FILES
    from simpletuner.testing.zoo import write_tiny_model

    model = write_tiny_model("wan22", tmp_path / "wan22")
    raw = make_config(
        pretrained_model_name_or_path=str(model),
        model_family="wan",
        max_train_steps=6,
        train_batch_size=1,
        checkpointing_steps=6,
    )
    proc = _launch(_write(raw, tmp_path / "cfg.json"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = Path(raw["output_dir"])
    for name in LORA_FILES.values():
        weights = load_file(out / name)
        assert weights and all(torch.isfinite(t).all() for t in weights.values())
