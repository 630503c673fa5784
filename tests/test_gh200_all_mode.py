"""``managed_memory: all`` over a run's life: the allocator settings it adds, routing ended when training
ends, no per-batch advice while routed, and the pool's bound counting the GPU's memory once where the OS
already counts it (GH200 in NUMA mode), read from NUMA layouts laid out as ``/sys/devices/system/node``.

CPU only, against the recording fake runtime (tests/fake_cuda.py). What the allocator then does with these
settings on a GPU is scripts/gpu_probe.py's to measure (cases ``bound`` and ``bound_all_mode``)."""

from __future__ import annotations

import logging

import pytest
import torch
from fake_cuda import GIB, FakeRuntime, discrete_info, gb10_info
from training_helpers import train

from simpletuner.configuration import validate_config
from simpletuner.gh200 import uvm
from simpletuner.gh200.managed_memory import (
    ALL_MODE_ALLOCATOR,
    allocator_settings,
    check_managed_memory,
    start_managed_memory,
    stop_managed_memory,
)
from simpletuner.hardware.host import collect_host, hbm_in_host_memory, memory_only_numa_bytes
from simpletuner.hardware.runtime import use_runtime

KIB = 1024
HOST = 400 * GIB


@pytest.fixture
def config(make_config):
    def _make(gh200=None, **overrides):
        return validate_config(make_config(gh200_optimizations=gh200 or {}, **overrides))

    return _make


# --- allocator settings ---------------------------------------------------------------------------
def test_all_adds_its_allocator_settings_and_says_each(config):
    settings, notes = allocator_settings(config({"managed_memory": "all"}), {})
    assert settings == ALL_MODE_ALLOCATOR == {"max_split_size_mb": 256, "release_lock_on_cudamalloc": True}
    assert len(notes) == 2 and "PYTORCH_CUDA_ALLOC_CONF gets max_split_size_mb:256" in notes[0]


def test_what_the_user_set_is_kept(config):
    cfg = config(
        {"managed_memory": "all"}, cuda_allocator={"max_split_size_mb": 512, "garbage_collection_threshold": 0.6}
    )
    settings, notes = allocator_settings(cfg, {"PYTORCH_CUDA_ALLOC_CONF": "release_lock_on_cudamalloc:False"})
    assert settings == {"max_split_size_mb": 512, "garbage_collection_threshold": 0.6}  # the env's value stays there
    assert notes == []


@pytest.mark.parametrize("mode", ["caches", "frozen_weights"])
def test_other_modes_add_nothing(config, mode):
    cfg = config({"managed_memory": mode}, cuda_allocator={"roundup_power2_divisions": 4})
    assert allocator_settings(cfg, {}) == ({"roundup_power2_divisions": 4}, [])


# --- routing ends with training --------------------------------------------------------------------
def test_start_routes_and_stop_ends_and_batch_advice_follows(config):
    runtime = FakeRuntime()
    plan = check_managed_memory(config({"managed_memory": "all"}), runtime, HOST)
    start_managed_memory(plan, runtime)
    with use_runtime(runtime):
        uvm.set_uvm_hint_override(True, "test")
        batch = {"latents": runtime.managed_empty((2, 4), torch.float32)}
        uvm.optimize_batch_for_gh200(batch, 0)
        assert [c.op for c in runtime.calls[-1:]] == ["prefetch"] and not runtime.ops("advise")
        stop_managed_memory(plan, runtime)
        uvm.optimize_batch_for_gh200(batch, 0)
    assert [c.op for c in runtime.calls if c.op in ("route_all", "end_routing")] == ["route_all", "end_routing"]
    assert [c.detail for c in runtime.ops("advise")] == ["preferred_location", "accessed_by"]  # advice is back


def test_a_trained_run_in_all_mode_ends_routing_once(make_config, tmp_path, caplog):
    runtime = FakeRuntime()
    raw = make_config(
        gh200_optimizations={"managed_memory": "all"},
        cache_config={"vae_cache_type": "unified_memory", "text_cache_type": "unified_memory"},
        max_train_steps=2,
    )
    with use_runtime(runtime), caplog.at_level(logging.INFO):
        train(raw)
    ops = [c.op for c in runtime.calls if c.op in ("route_all", "end_routing")]
    assert ops == ["route_all", "end_routing"]
    said = caplog.text
    assert "PYTORCH_CUDA_ALLOC_CONF gets max_split_size_mb:256" in said and 'managed_memory "all" ended' in said


# --- NUMA: the GPU's memory counted once --------------------------------------------------------------
#: NUMA layouts as /sys/devices/system/node shows them: node -> (cpulist, MemTotal kB).
#: "ci_vm": recorded on this project's 2-core CI machine class (2026-11-27). The GH200 layouts follow
#: NVIDIA's Grace Hopper description (NUMA mode, the default: node 0 = Grace's CPUs and LPDDR5X, node 1 =
#: the HBM with no CPU, nodes 2-9 empty placeholders for MIG; CDMM mode: the HBM is not given to the OS);
#: their sizes are of a 480 GB / 96 GB GH200, not captured on one. GB10: one node, CPUs and the shared memory.
LAYOUTS = {
    "ci_vm": {0: ("0-1", 10053848)},
    "x86_two_sockets": {0: ("0-55", 528000000), 1: ("56-111", 528000000)},
    "gh200_numa": {0: ("0-71", 491520000), 1: ("", 99614720), **{n: ("", 0) for n in range(2, 10)}},
    "gh200_cdmm": {0: ("0-71", 491520000)},
    "gb10": {0: ("0-19", 125829120)},
}


def lay_out(root, layout):
    for node, (cpus, kib) in layout.items():
        folder = root / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpus + "\n")
        (folder / "meminfo").write_text(f"Node {node} MemTotal:       {kib} kB\nNode {node} MemFree:        {kib} kB\n")
    (root / "online").write_text(f"0-{max(layout)}\n")  # not a node: skipped
    return str(root)


@pytest.mark.parametrize(
    ("name", "memory_only"),
    [("ci_vm", 0), ("x86_two_sockets", 0), ("gh200_numa", 99614720 * KIB), ("gh200_cdmm", 0), ("gb10", 0)],
)
def test_memory_only_nodes(tmp_path, name, memory_only):
    assert memory_only_numa_bytes(lay_out(tmp_path, LAYOUTS[name])) == memory_only


def test_an_unreadable_layout_counts_nothing(tmp_path):
    assert memory_only_numa_bytes(str(tmp_path / "missing")) == 0
    assert collect_host(numa_root=str(tmp_path / "missing"))["memory_only_numa_bytes"] == 0


@pytest.mark.parametrize(
    ("name", "info", "backable"),
    [
        ("gh200_numa", None, HOST),  # MemAvailable holds the HBM node already
        ("gh200_cdmm", None, HOST + 90 * GIB),  # the HBM is the driver's: counted beside MemAvailable
        ("x86_two_sockets", discrete_info, HOST + 90 * GIB),
        ("gb10", gb10_info, HOST),  # one memory
    ],
)
def test_the_all_bound_counts_gpu_memory_once(config, tmp_path, name, info, backable):
    memory_only = memory_only_numa_bytes(lay_out(tmp_path, LAYOUTS[name]))
    runtime = FakeRuntime(free_bytes=90 * GIB) if info is None else FakeRuntime(info=info(), free_bytes=90 * GIB)
    opts = {"managed_memory": "all", "force_managed_memory": info is discrete_info}
    plan = check_managed_memory(config(opts), runtime, HOST, memory_only_numa_bytes=memory_only)
    assert plan.backable_bytes == backable


def test_numa_mode_refusal_names_what_it_counted(config, tmp_path):
    memory_only = memory_only_numa_bytes(lay_out(tmp_path, LAYOUTS["gh200_numa"]))
    with pytest.raises(ValueError, match="available memory, the GPU's NUMA node included"):
        check_managed_memory(
            config({"managed_memory": "all", "oversubscription_ratio": 4.5}),
            FakeRuntime(free_bytes=90 * GIB),
            HOST,
            memory_only_numa_bytes=memory_only,
        )


def test_hbm_in_host_memory_needs_a_node_of_the_gpus_size():
    assert hbm_in_host_memory(96 * GIB, 95 * GIB)
    assert not hbm_in_host_memory(96 * GIB, 0)
    assert not hbm_in_host_memory(96 * GIB, 1 * GIB)  # a small CPU-less node (CXL, firmware) is not the GPU
    assert not hbm_in_host_memory(None, 95 * GIB)
