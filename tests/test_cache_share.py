"""A cache fill shared by the processes of a launch (simpletuner/caching/share.py).

The split is checked as a property; the fill itself runs in two real processes joined by a gloo
process group (the collectives Accelerate uses on CPU), each with its own store on one folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st

from simpletuner.caching.opening import open_tensor_cache
from simpletuner.caching.share import split_batches, split_misses
from simpletuner.diskspace import NoSpace

NUM_ITEMS = 12


@given(st.integers(0, 60), st.integers(1, 5))
def test_split_is_contiguous_disjoint_and_balanced(num_keys, num_ranks):
    keys = [f"k{i}" for i in range(num_keys)]
    parts = split_misses(keys, num_ranks)
    assert len(parts) == num_ranks
    assert [key for part in parts for key in part] == keys  # in order: contiguous runs, nothing lost or repeated
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1


@given(st.lists(st.integers(1, 9), min_size=1, max_size=12), st.integers(1, 4))
def test_split_keeps_each_shard_on_one_rank(shard_sizes, num_ranks):
    keys = [f"s{s}/m{m}" for s, size in enumerate(shard_sizes) for m in range(size)]
    parts = split_misses(keys, num_ranks, locality=lambda key: key.split("/")[0])
    assert [key for part in parts for key in part] == keys
    owner = {}
    for rank, part in enumerate(parts):
        for key in part:
            assert owner.setdefault(key.split("/")[0], rank) == rank
    # whole shards cost at most one shard of imbalance beyond an even split
    assert max(len(part) for part in parts) <= -(-len(keys) // num_ranks) + max(shard_sizes)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=20), st.integers(1, 4))
def test_split_batches_keeps_each_batch_whole_and_in_order(batch_sizes, num_ranks):
    batches = [[f"b{b}k{k}" for k in range(size)] for b, size in enumerate(batch_sizes)]
    parts = split_batches(batches, num_ranks)
    assert [batch for part in parts for batch in part] == batches
    sizes = [sum(len(batch) for batch in part) for part in parts]
    assert max(sizes) - min(sizes) <= 2 * max(batch_sizes)  # balanced to within whole batches


def test_a_shared_fill_encodes_the_batches_of_a_single_process_fill(tmp_path):
    """Each rank encodes (the missing entries of) whole batches of the plan a single process makes over
    every item: an entry meets the same batch-mates (and so the same float rounding) in both."""
    from fakes import RecordingEncoder, SequentialShare, bucket_of, latent_items

    from simpletuner.caching import ShardedTensorStore, TensorCache

    items = latent_items(23)
    present = {key for key, _ in items[2:9]}  # what an interrupted fill left
    calls, launch = {}, SequentialShare()
    for who in ("single", 0, 1):
        store = ShardedTensorStore(tmp_path / str(who))
        store.put_many({key: {"latent": torch.zeros(1)} for key in present})
        encoder = RecordingEncoder()
        share = None if who == "single" else launch.rank(who)
        TensorCache(store, "vae").fill(items, encoder, batch_size=4, group=bucket_of, share=share)
        calls[who] = [[payload["id"] for payload in call] for call in encoder.calls]
    assert calls[0] and calls[1] and sorted(calls[0] + calls[1]) == sorted(calls["single"])
    assert any(len(call) > 1 for call in calls["single"])


class _GlooShare:
    def __init__(self):
        self.rank, self.num_ranks = dist.get_rank(), dist.get_world_size()

    def from_first(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def from_all(self, value):
        out = [None] * self.num_ranks
        dist.all_gather_object(out, value)
        return out


def _entry(payload: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((3,), float(payload))}


def _fill_once(folder: Path, kind: str, persistent: bool, share, fail: str | None = None, kill_after: int = 0):
    """One fill of NUM_ITEMS items; returns (payloads this process computed, report or the exception)."""
    cache = open_tensor_cache(folder, kind, "vae", persistent=persistent)
    cache.flush_every = 2
    computed: list[int] = []

    def compute(payloads):
        if kill_after and len(computed) >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: what is not in a written shard is lost
        if fail == "error":
            raise ValueError("this encoder is broken")
        if fail == "no_space":
            raise NoSpace("VAE latents", folder, 10**9, 10, during_write=True)
        computed.extend(payloads)
        return [_entry(p) for p in payloads]

    items = [(f"key{i:02d}", i) for i in range(NUM_ITEMS)]
    try:
        report = cache.fill(items, compute, batch_size=2, share=share)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return computed, {"error": type(exc).__name__, "message": str(exc), "agreed": getattr(exc, "agreed", None)}
    held = {key: cache.get(key)["x"][0].item() for key, _ in items}
    return computed, {"computed": report.num_computed, "hits": report.num_hits, "held": held}


def _worker(rank: int, world: int, port: int, root: str, scenarios: list[dict]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    share = _GlooShare()
    results = {}
    for scenario in scenarios:
        name = scenario["name"]
        fail = scenario.get("fail") if rank == scenario.get("fail_rank", -1) else None
        kill = scenario.get("kill_after", 0) if rank == scenario.get("fail_rank", -1) else 0
        results[name] = _fill_once(Path(root) / name, scenario["kind"], scenario["persistent"], share, fail, kill)
        Path(root, f"result-{rank}.json").write_text(json.dumps(results))  # written as it goes: a rank may die
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(root: Path, scenarios: list[dict]) -> dict[int, dict]:
    """Both ranks to their end (a rank that dies does not take the other with it); rank -> its results."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    processes = [ctx.Process(target=_worker, args=(rank, 2, port, str(root), scenarios)) for rank in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=180)
    return {
        rank: json.loads(path.read_text()) if (path := root / f"result-{rank}.json").exists() else {} for rank in (0, 1)
    }


@pytest.fixture(scope="module")
def shared_fills(tmp_path_factory):
    """Two processes fill folders together, once per scenario (one spawn for all of them); rank 1 dies in the
    last one (results are written as they come, so the earlier ones are kept)."""
    root = tmp_path_factory.mktemp("share")
    scenarios = [
        {"name": "disk", "kind": "disk", "persistent": True},
        {"name": "memory_backed", "kind": "memory", "persistent": True},
        {"name": "memory_only", "kind": "memory", "persistent": False},
        {"name": "error", "kind": "disk", "persistent": True, "fail": "error", "fail_rank": 1},
        {"name": "no_space", "kind": "disk", "persistent": True, "fail": "no_space", "fail_rank": 1},
        {"name": "killed", "kind": "disk", "persistent": True, "kill_after": 2, "fail_rank": 1},  # last: rank 1 dies
    ]
    return root, _run(root, scenarios)


@pytest.mark.parametrize("name", ["disk", "memory_backed"])
def test_each_rank_encodes_its_part_and_reads_every_entry(shared_fills, name):
    root, results = shared_fills
    (mine0, report0), (mine1, report1) = results[0][name], results[1][name]
    assert mine0 and mine1 and not set(mine0) & set(mine1)  # both worked, on disjoint parts
    assert sorted(mine0 + mine1) == list(range(NUM_ITEMS))
    for report in (report0, report1):
        assert report["computed"] == NUM_ITEMS and report["hits"] == 0  # counts every rank's work
        assert report["held"] == {f"key{i:02d}": float(i) for i in range(NUM_ITEMS)}  # and reads the others'
    assert len(list((root / name).glob("shard-*.safetensors"))) >= 2


def test_a_memory_cache_of_its_own_is_filled_whole_on_every_rank(shared_fills):
    _, results = shared_fills
    for rank in (0, 1):
        mine, report = results[rank]["memory_only"]
        assert sorted(mine) == list(range(NUM_ITEMS)) and report["computed"] == NUM_ITEMS


def test_an_error_on_one_rank_stops_every_rank_naming_it(shared_fills):
    root, results = shared_fills
    _, on_rank1 = results[1]["error"]
    assert on_rank1["error"] == "ValueError" and "this encoder is broken" in on_rank1["message"]
    mine0, on_rank0 = results[0]["error"]
    assert on_rank0["error"] == "RuntimeError"
    assert "process 1" in on_rank0["message"] and "this encoder is broken" in on_rank0["message"]
    # rank 0's part is kept: a rerun encodes only rank 1's
    cache = open_tensor_cache(root / "error", "disk", "vae")
    assert sorted(int(k[3:]) for k in cache.store.keys()) == sorted(mine0)


def test_a_full_disk_on_one_rank_is_the_same_no_space_on_every_rank(shared_fills):
    _, results = shared_fills
    assert results[1]["no_space"][1]["error"] == "NoSpace"
    assert results[0]["no_space"][1] == {
        "error": "NoSpace",
        "message": results[1]["no_space"][1]["message"],
        "agreed": True,
    }


def test_a_rank_killed_mid_fill_loses_only_its_unfinished_part(shared_fills):
    root, results = shared_fills
    assert "killed" not in results[1]  # it died inside the fill
    assert results[0]["killed"][1]["error"]  # rank 0 learns of it in the collective and stops too
    rerun_computed, rerun = _fill_once(root / "killed", "disk", True, share=None)
    # Rank 1 got the second half (6 items); it wrote its first shard (2 items) and died encoding the next.
    assert sorted(rerun_computed) == list(range(8, NUM_ITEMS))
    assert rerun["hits"] == 8 and rerun["computed"] == 4
    assert rerun["held"] == {f"key{i:02d}": float(i) for i in range(NUM_ITEMS)}
