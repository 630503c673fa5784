"""Two "nodes" on this machine: two `accelerate launch --num_machines 2 --machine_rank {0,1}` launchers
of one process each, meeting at 127.0.0.1 (gloo on CPU), with one shared output_dir and cache_dir.

Two launches: a run that trains (disjoint shares of every batch, one cache written once, both
ranks' files in the shared checkpoint), and a node that joins with another config (both stop
before anything is written, naming the differing keys).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from training_helpers import tiny_config

from simpletuner.training.launch import describe_config_differences, flatten_config

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
#: Steps of the run: two epochs of the 12-image dataset at 2 samples x 2 ranks per step.
STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_cmd(config: Path, machine_rank: int, port: int, *extra: str) -> list[str]:
    """The launch of one node of two, one process each (as on a real cluster, with rank 0's address)."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_machines",
        "2",
        "--machine_rank",
        str(machine_rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(ROOT / "simpletuner" / "train.py"),
        "--config",
        str(config),
        *extra,
    ]


def _two_nodes(
    configs: tuple[Path, Path], logs: Path, *extra: str, node1_prefix: tuple[str, ...] = ()
) -> list[tuple[int, str]]:
    """Launch node 0 and node 1 (each with its own config file; node 1's command after ``node1_prefix``)
    and wait for both: ``[(exit code, stderr)]``. stderr goes to files, so neither launcher blocks on a
    full pipe while the other is waited for."""
    port = _free_port()
    procs, files = [], []
    for rank, config in enumerate(configs):
        err = open(logs / f"node{rank}.err", "w")
        files.append(err)
        procs.append(
            subprocess.Popen(
                [*(node1_prefix if rank else ()), *_node_cmd(config, rank, port, *extra)],
                cwd=ROOT,
                env=ENV,
                stdout=subprocess.DEVNULL,
                stderr=err,
                text=True,
            )
        )
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in files:
            f.close()
    return [(code, (logs / f"node{rank}.err").read_text()) for rank, code in enumerate(codes)]


def _write(raw: dict, path: Path) -> Path:
    path.write_bytes(orjson.dumps(raw))
    return path


@pytest.fixture(scope="module")
def two_nodes(tiny_sd, shapes_dir, tmp_path_factory):
    """One two-node run of STEPS steps: ``(raw config, [(exit code, stderr) of node 0, node 1])``. Read only."""
    root = tmp_path_factory.mktemp("multinode")
    raw = tiny_config(tiny_sd, shapes_dir, root, max_train_steps=STEPS, checkpointing_steps=STEPS, train_batch_size=2)
    config = _write(raw, root / "config.json")
    return raw, _two_nodes((config, config), root, "--log-level", "DEBUG")  # DEBUG: each rank's batches


def _micro_batches(stderr: str) -> dict[int, list[list[str]]]:
    """rank -> the sample keys of each of its micro-batches, from the DEBUG lines the trainer logs."""
    seen: dict[int, list[list[str]]] = {}
    for rank, keys in re.findall(r"rank (\d) micro-batch: (\[.*?\])", stderr):
        seen.setdefault(int(rank), []).append(orjson.loads(keys.replace("'", '"')))
    return seen


@pytest.mark.slow
def test_two_nodes_train_disjoint_shares_of_every_batch(two_nodes, shapes_dir):
    raw, nodes = two_nodes
    for rank, (code, err) in enumerate(nodes):
        assert code == 0, f"node {rank}:\n{err[-4000:]}"
    # Each node's log holds only its own rank's batches: the ranks really are the two launches.
    node0, node1 = _micro_batches(nodes[0][1]), _micro_batches(nodes[1][1])
    assert list(node0) == [0] and list(node1) == [1]
    steps0, steps1 = node0[0], node1[1]
    assert len(steps0) == len(steps1) == STEPS
    images = sorted(p.name for p in shapes_dir.glob("*.png"))
    for a, b in zip(steps0, steps1):
        assert len(a) == len(b) == 2 and not set(a) & set(b), (a, b)
        # one global batch: both shares are of one shape (sizes read from the files themselves)
        sizes = {Image.open(shapes_dir / key.split("/", 1)[1]).size for key in a + b}
        assert len(sizes) == 1, (a, b, sizes)
    first_epoch = [k.split("/", 1)[1] for step in steps0[:3] + steps1[:3] for k in step]
    assert sorted(first_epoch) == images  # 3 steps x 2 ranks x 2 samples: each image once

    out = Path(raw["output_dir"])
    weights = load_file(out / "pytorch_lora_weights.safetensors")
    assert weights
    checkpoint = out / f"checkpoint-{STEPS}"
    assert sorted(p.name for p in checkpoint.glob("rng_state_*.pt")) == ["rng_state_0.pt", "rng_state_1.pt"]
    state = orjson.loads((checkpoint / "trainer_state.json").read_bytes())
    assert state["world_size"] == 2 and state["samples_seen"] == STEPS * 2 * 2


def _cache_entries(cache_dir: Path) -> dict[Path, list[str]]:
    """folder -> the entry keys of every shard in it (repeats kept), read from the safetensors headers
    (tensor names are ``"{entry key}|{tensor name}"``)."""
    found: dict[Path, list[str]] = {}
    for shard in sorted(cache_dir.rglob("shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            keys = {name.split("|", 1)[0] for name in f.keys()}
        found.setdefault(shard.parent, []).extend(keys)
    return found


@pytest.mark.slow
def test_two_nodes_fill_one_shared_cache_once(two_nodes, shapes_dir):
    raw, nodes = two_nodes
    assert all(code == 0 for code, _ in nodes)
    entries = _cache_entries(Path(raw["cache_config"]["cache_dir"]))
    assert sorted(folder.name for folder in entries) == ["text", "vae"], entries
    images = len(list(shapes_dir.glob("*.png")))
    captions = len({p.read_text().strip() for p in shapes_dir.glob("*.txt")})
    by_name = {folder.name: keys for folder, keys in entries.items()}
    # every entry written once across both ranks' shards: no sample encoded twice
    assert len(by_name["vae"]) == len(set(by_name["vae"])) == images
    assert len(by_name["text"]) == len(set(by_name["text"])) == captions


@pytest.mark.slow
def test_a_node_with_another_config_stops_both_before_writing(tiny_sd, shapes_dir, tmp_path):
    raw = tiny_config(tiny_sd, shapes_dir, tmp_path, max_train_steps=2, checkpointing_steps=1)
    other = dict(raw, learning_rate=2e-3)
    configs = (_write(raw, tmp_path / "node0.json"), _write(other, tmp_path / "node1.json"))
    nodes = _two_nodes(configs, tmp_path)
    for rank, (code, err) in enumerate(nodes):
        assert code != 0, f"node {rank} went on:\n{err[-4000:]}"
        assert "exitcode  : 2" in err, err[-4000:]  # the training process's own code: bad input
        # each node's console names the key and both values
        assert "learning_rate (rank 0: 0.001; rank 1: 0.002)" in err, err[-4000:]
    assert "error: the processes of this launch were started with different configs" in nodes[0][1]
    assert not Path(raw["output_dir"]).exists()  # no checkpoint, weights, config copy or log
    assert not Path(raw["cache_config"]["cache_dir"]).exists()  # nothing encoded either


def _can_unshare_mounts() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare_mounts(), reason="needs `unshare -m` (root or user namespaces)")
def test_an_output_dir_that_is_not_shared_stops_both_before_training(tiny_sd, shapes_dir, tmp_path):
    """Node 1 sees an empty node-local disk at output_dir's path (a tmpfs mounted over its parent in
    a mount namespace of its own): both stop at start-up, exit 2, before a step is trained."""
    outs = tmp_path / "outs"
    outs.mkdir()
    raw = tiny_config(tiny_sd, shapes_dir, tmp_path, output_dir=str(outs / "output"), checkpointing_steps=1)
    config = _write(raw, tmp_path / "config.json")
    local_disk = ("unshare", "-m", "--propagation", "private", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"')
    nodes = _two_nodes((config, config), tmp_path, node1_prefix=(*local_disk, str(outs)))
    for rank, (code, err) in enumerate(nodes):
        assert code != 0 and "exitcode  : 2" in err, f"node {rank}:\n{err[-4000:]}"
        assert f"output_dir {outs / 'output'} is not one shared folder: rank 1" in err, err[-4000:]
    assert [p.name for p in (outs / "output").iterdir()] == [".simpletuner.lock"]  # the probe is gone, no step ran
    assert not Path(raw["cache_config"]["cache_dir"]).exists()


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare_mounts(), reason="needs `unshare -m` (root or user namespaces)")
def test_per_node_cache_folders_are_each_filled_whole(tiny_sd, shapes_dir, tmp_path):
    """Node 1 has a node-local disk at cache_dir's path: the ranks cannot share the encoding, so each
    fills its own folder whole (said in the log) and the run trains; rank 0's folder holds every entry."""
    caches = tmp_path / "caches"
    caches.mkdir()
    raw = tiny_config(tiny_sd, shapes_dir, tmp_path, max_train_steps=2, checkpointing_steps=2)
    raw["cache_config"] = {"cache_dir": str(caches / "cache")}
    config = _write(raw, tmp_path / "config.json")
    local_disk = ("unshare", "-m", "--propagation", "private", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"')
    nodes = _two_nodes((config, config), tmp_path, node1_prefix=(*local_disk, str(caches)))
    for rank, (code, err) in enumerate(nodes):
        assert code == 0, f"node {rank}:\n{err[-4000:]}"
        assert "are not one folder for every process" in err
        assert re.search(r"vae cache: 12 items, 0 hits, 12 computed", err), err[-4000:]  # the whole cache, alone
    by_name = {folder.name: keys for folder, keys in _cache_entries(caches / "cache").items()}
    assert len(by_name["vae"]) == len(set(by_name["vae"])) == 12  # node 0's own folder: every entry once
    assert (Path(raw["output_dir"]) / "pytorch_lora_weights.safetensors").is_file()


def test_differences_group_ranks_and_hide_secrets():
    base = {"learning_rate": 1e-3, "datasets": [{"id": "a", "access_key": "K1"}], "seed": 1}
    other = {"learning_rate": 2e-3, "datasets": [{"id": "a", "access_key": "K2"}], "seed": 1}
    flat = [flatten_config(base), flatten_config(other), flatten_config(other), flatten_config(base)]
    lines = describe_config_differences(flat, ["a", "b", "b", "a"])
    assert lines == [
        "ranks 1, 2 (host b) differ from rank 0 (host a) in: "
        "datasets[0].access_key (rank 0: <hidden>; ranks 1, 2: <hidden>), "
        "learning_rate (rank 0: 0.001; ranks 1, 2: 0.002)"
    ]
    assert describe_config_differences(flat[:1] + flat[3:], ["a", "a"]) == []
    longer = flatten_config(dict(base, datasets=base["datasets"] * 2))
    (line,) = describe_config_differences([flat[0], longer], ["a", "a"])
    assert 'datasets[1].id (rank 0: not set; rank 1: "a")' in line


def test_a_launch_for_several_machines_without_multi_gpu_is_refused(tmp_path):
    """Without --multi_gpu, `accelerate launch` on a machine with fewer than two GPUs starts each
    machine's process alone (no WORLD_SIZE): every machine would train the whole run by itself."""
    from simpletuner.training.launch import LaunchError, check_launch_matches

    node = ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1", "--num_processes", "2"]
    with pytest.raises(LaunchError, match=r"asked for 2 process\(es\) on 2 machine\(s\).*Add --multi_gpu"):
        check_launch_matches(1, {}, [*node, "simpletuner/train.py"])
    yaml = tmp_path / "node1.yaml"
    yaml.write_text("distributed_type: 'NO'\nnum_machines: 2\nmachine_rank: 1\nnum_processes: 2\n")
    with pytest.raises(LaunchError, match=r"asked for 2 process\(es\) on 2 machine\(s\)"):
        check_launch_matches(1, {}, ["--config_file", str(yaml), "simpletuner/train.py"])
    check_launch_matches(1, {}, ["simpletuner/train.py"])  # one process, as asked
    check_launch_matches(1, {}, None)  # no launcher
    check_launch_matches(2, {"WORLD_SIZE": "2"}, ["--multi_gpu", *node, "simpletuner/train.py"])
