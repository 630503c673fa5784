"""scripts/gpu_check.py and scripts/bench_mfu.py on CPU: the no-GPU run, the sizing and its safety
bounds, the Markdown tables, each managed-memory mode against the recording fake runtime, and the
MFU benchmark through the real trainer on the tiny model."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_cuda import FakeRuntime, discrete_info, gb10_info, gh200_info

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
MIB = 1 << 20


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")
gpu_check_workers = _load("gpu_check_workers")
bench_mfu = _load("bench_mfu")
CheckResult = gpu_check.CheckResult


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


# --- the run without a GPU ----------------------------------------------------------------------------
def test_without_cuda_the_script_exits_3_and_writes_every_check_skipped(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(out)], capture_output=True, text=True, env=_env()
    )
    assert proc.returncode == 3, proc.stderr
    assert "nothing measured" in proc.stdout
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["exit_code"] == 3 and data["machine"]["cuda"] is False
    reason = data["machine"]["reason"]
    assert reason  # "this PyTorch build ... has no CUDA" or "no CUDA device ..."
    assert [c["name"] for c in data["checks"]] == list(gpu_check.CHECKS)
    for check in data["checks"]:
        assert check["status"] == "skipped" and check["reason"] == f"no CUDA device: {reason}"
    assert data["machine"]["versions"]["torch"] and data["machine"]["host"]["ram_total_bytes"] > 0
    md = (out / "gpu_check.md").read_text().splitlines()
    assert md[0].startswith("Machine: no CUDA device (") and "profile quick" in md[0]
    assert md[2:4] == ["| check | status | key figures |", "|---|---|---|"]
    assert md[4:9] == [f"| {name} | skipped | no CUDA device: {reason} |" for name in gpu_check.CHECKS]
    assert len(md) == 9  # no modes ran: no per-mode table


def test_bad_flags_are_refused_before_anything_runs(tmp_path):
    for argv, message in (
        (["--hbm-fraction", "0"], "--hbm-fraction must be > 0"),
        (["--checks", "mfu,nope"], "--checks: unknown nope"),
    ):
        with pytest.raises(SystemExit, match=message):
            gpu_check.main(["--out", str(tmp_path), *argv])
    assert not (tmp_path / "gpu_check.json").exists()


# --- sizing and its bounds ----------------------------------------------------------------------------
def test_diagnostic_scale_is_125_on_unified_devices_with_room():
    assert gpu_check.diagnostic_scale(gh200_info(), 95 * GIB, 400 * GIB) == (1.25, "run")
    assert gpu_check.diagnostic_scale(gb10_info(), 110 * GIB, 200 * GIB) == (1.25, "run")


@pytest.mark.parametrize(
    "info, free, host, expected",
    [
        (gh200_info(), 90 * GIB, 50 * GIB, 1.16),  # 0.8 x (50 + 90) GiB = 112 GiB over 96 GiB
        (gb10_info(), 110 * GIB, 100 * GIB, 0.67),  # integrated: host memory only; 80 GiB over 119 GiB
    ],
    ids=["gh200", "gb10"],
)
def test_diagnostic_scale_is_bounded_by_what_the_machine_can_back(info, free, host, expected):
    scale, expect = gpu_check.diagnostic_scale(info, free, host)
    assert (scale, expect) == (expected, "run")
    backable = host if info.integrated else host + free
    assert scale * info.total_bytes <= 0.8 * backable


def test_diagnostic_scale_on_a_discrete_gpu_expects_the_refusal_and_unknown_host_skips():
    assert gpu_check.diagnostic_scale(discrete_info(), 79 * GIB, 100 * GIB) == (1.25, "refused")
    scale, why = gpu_check.diagnostic_scale(gh200_info(), 90 * GIB, None)
    assert scale is None and "MemAvailable unreadable" in why
    scale, why = gpu_check.diagnostic_scale(gh200_info(), 0, 0)
    assert scale is None and "only 0.0 GiB" in why


def test_modes_on_gh200_default_to_125_hbm_caches_expected_to_oom():
    info, free, host = gh200_info(), 94 * GIB, 400 * GIB
    fraction = gpu_check.default_fraction(info)
    assert fraction == 1.25
    caches, frozen, every = (gpu_check.size_mode(m, info, free, host, fraction) for m in gpu_check.MODES)
    assert caches.model_bytes == int(1.25 * info.total_bytes) and caches.expect == "oom"
    assert caches.cap_bytes is None and caches.oversubscription_ratio is None and not caches.force
    cap = int(0.8 * (host + free))
    assert (frozen.expect, frozen.cap_bytes, frozen.force, frozen.oversubscription_ratio) == ("run", cap, False, None)
    # `all`: the pool holds the weights + one HBM's worth, never more than the cap
    assert (every.expect, every.cap_bytes, every.oversubscription_ratio) == ("run", cap, 2.25)


def test_modes_on_a_discrete_gpu_use_04_with_consent_and_the_cards_free_memory_as_cap():
    info, free, host = discrete_info(), 79 * GIB, 120 * GIB
    fraction = gpu_check.default_fraction(info)
    assert fraction == 0.4
    caches, frozen, every = (gpu_check.size_mode(m, info, free, host, fraction) for m in gpu_check.MODES)
    assert caches.expect == "run" and not caches.force
    cap = int(0.9 * free)  # below 0.8 x (host + free)
    assert (frozen.expect, frozen.cap_bytes, frozen.force) == ("run", cap, True)
    assert (every.expect, every.force) == ("run", True)
    assert every.oversubscription_ratio == math.floor(10_000 * cap / info.total_bytes) / 10_000
    assert every.oversubscription_ratio * info.total_bytes <= cap


@pytest.mark.parametrize(
    "info, free, host",
    [(discrete_info(), 79 * GIB, 500 * GIB), (gh200_info(), 94 * GIB, 20 * GIB), (gb10_info(), 100 * GIB, 60 * GIB)],
    ids=["discrete", "gh200-little-host-memory", "gb10"],
)
@pytest.mark.parametrize("fraction", [0.1, 0.4, 0.9, 1.25, 2.0, 4.0])
def test_managed_memory_never_exceeds_the_cap(info, free, host, fraction):
    for mode in ("frozen_weights", "all"):
        sizing = gpu_check.size_mode(mode, info, free, host, fraction)
        backable = host if info.integrated else host + free
        assert sizing.cap_bytes <= 0.8 * backable
        if not info.unified:
            assert sizing.cap_bytes <= 0.9 * free
        if sizing.expect == "run":
            assert sizing.model_bytes <= sizing.cap_bytes
            if mode == "all":
                assert sizing.oversubscription_ratio * info.total_bytes <= sizing.cap_bytes
        else:
            assert sizing.expect == "refused" and "lower --hbm-fraction" in sizing.reason


def test_size_mode_refuses_without_host_memory_and_rejects_bad_input():
    sizing = gpu_check.size_mode("all", gh200_info(), 90 * GIB, None, 1.25)
    assert sizing.expect == "refused" and "MemAvailable unreadable" in sizing.reason
    refused = gpu_check.size_mode("frozen_weights", discrete_info(), 79 * GIB, 500 * GIB, 1.0)
    assert refused.expect == "refused" and "0.9 x the card's free memory" in refused.reason
    with pytest.raises(ValueError, match="mode must be one of caches, frozen_weights, all"):
        gpu_check.size_mode("everything", gh200_info(), 0, 0, 1.0)
    with pytest.raises(ValueError, match="--hbm-fraction must be > 0"):
        gpu_check.size_mode("all", gh200_info(), 0, 0, 0)


# --- rendering ------------------------------------------------------------------------------------------
MACHINE = {
    "cuda": True,
    "date": "2026-11-24T00:00:00+00:00",
    "profile": "quick",
    "device": {"name": "NVIDIA GH200 480GB", "total_bytes": 96 * GIB, "kind": "coherent"},
    "versions": {"torch": "2.13.0", "cuda_build": "12.8", "driver": "12.8", "cuda_bindings": "12.8.0"},
    "host": {"ram_total_bytes": 480 * GIB, "ram_available_bytes": 400 * GIB},
}


def _results() -> list:
    modes = CheckResult(
        "managed_modes",
        "passed",
        details={
            "modes": [
                {"mode": "caches", "model_bytes": 120 * GIB, "outcome": "oom", "expect": "oom"},
                {
                    "mode": "frozen_weights",
                    "model_bytes": 120 * GIB,
                    "step_s": 1.23456,
                    "peak_hbm_bytes": 12 * GIB,
                    "pool_bytes": 120 * GIB,
                    "outcome": "ran",
                    "expect": "run",
                },
                {"mode": "all", "model_bytes": 120 * GIB, "outcome": "refused", "reason": "a | b"},
            ]
        },
    )
    return [
        CheckResult("gpu_tests", "passed", 12.0, {"passed": 4, "failed": 0}),
        CheckResult("diagnostic", "refused", 3.0, {"scale": 1.25}, "refusing: discrete | PCIe"),
        CheckResult("mfu", "passed", 40.0, {"mfu": 0.41234, "tflops": 407.9, "peak_memory_gib": None}),
        modes,
    ]


def test_markdown_has_the_check_table_and_the_mode_table():
    md = gpu_check.render_markdown(MACHINE, _results()).splitlines()
    assert md[0] == (
        "Machine: NVIDIA GH200 480GB, 96.0 GiB, coherent; driver 12.8, torch 2.13.0, CUDA build 12.8, "
        "cuda-bindings 12.8.0; host RAM 480.0 GiB (400.0 available); 2026-11-24T00:00:00+00:00; profile quick"
    )
    assert md[2:8] == [
        "| check | status | key figures |",
        "|---|---|---|",
        "| gpu_tests | passed | passed 4; failed 0 |",
        "| diagnostic | refused | scale 1.25; refusing: discrete \\| PCIe |",
        "| mfu | passed | mfu 0.412; tflops 408 |",
        "| managed_modes | passed | - |",
    ]
    assert md[8:] == [
        "",
        "| mode | model GiB | step s | peak HBM GiB | pool GiB | outcome |",
        "|---|---|---|---|---|---|",
        "| caches | 120.0 | - | - | - | OOM (expected) |",
        "| frozen_weights | 120.0 | 1.235 | 12.0 | 120.0 | ran |",
        "| all | 120.0 | - | - | - | refused: a \\| b |",
    ]


def test_outcome_text_and_status_of_a_mode_run():
    assert gpu_check.outcome_text({"outcome": "ran", "expect": "oom", "step_s": 0.5}, with_step=True) == (
        "ran 0.500 s/step (OOM was expected)"
    )
    assert gpu_check.outcome_text({"outcome": "oom", "expect": "run"}) == "OOM (unexpected)"
    assert gpu_check.mode_status({"outcome": "oom", "expect": "oom"}) == "passed"
    assert gpu_check.mode_status({"outcome": "oom", "expect": "run"}) == "failed"
    assert gpu_check.mode_status({"outcome": "refused"}) == "refused"
    assert gpu_check.mode_status({"outcome": "timed out"}) == "failed"


def test_exit_code_and_outputs_written_atomically(tmp_path):
    results = _results()
    assert gpu_check.exit_code(MACHINE, results) == 0  # refused / skipped for a reason are not failures
    assert gpu_check.exit_code(MACHINE, [*results, CheckResult("x", "failed")]) == 1
    assert gpu_check.exit_code({"cuda": False}, results) == 3
    gpu_check.write_outputs(tmp_path, MACHINE, results)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md"]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["exit_code"] == 0 and [c["name"] for c in data["checks"]] == [r.name for r in results]


def test_parsers_of_pytest_and_of_json_after_logs():
    text = "....s\n4 passed, 1 skipped, 120 deselected, 2 errors in 3.2s\n"
    assert gpu_check.parse_pytest(text) == {"passed": 4, "failed": 0, "skipped": 1, "errors": 2, "deselected": 120}
    assert gpu_check.last_json('log {not json}\n{"a": 1}\nwarning\n{"b": {"c": 2}}\n') == {"b": {"c": 2}}
    assert gpu_check.last_json("no json here") is None


def test_a_command_past_its_timeout_is_killed_with_its_children(tmp_path):
    start = time.monotonic()
    rc, out, _ = gpu_check.run_process(["bash", "-c", "echo started; sleep 30 & wait"], 1, tmp_path / "log")
    assert rc == 124 and out == "started\n"
    assert time.monotonic() - start < 10  # the grandchild sleep was killed too: communicate() did not wait for it


# --- the mode worker against the fake runtime (CPU tensors stand for managed memory) ------------------
def _small(preset, total=16 * MIB):
    return FakeRuntime(info=dataclasses.replace(preset(), total_bytes=total))


@pytest.mark.parametrize("preset", [gh200_info, discrete_info])
def test_each_mode_runs_on_the_fake_runtime_within_its_bounds(tmp_path, preset):
    rows = {}
    for mode in gpu_check.MODES:
        fake = _small(preset)
        path = tmp_path / f"{mode}.json"
        assert gpu_check_workers.mode_worker(mode, path, 2, None, width=256, tokens=8, runtime=fake, device="cpu") == 0
        row = rows[mode] = json.loads(path.read_text())
        block = 2 * 256 * 256 * 2
        fraction = 1.25 if preset().unified else 0.4
        assert (
            row["num_blocks"] == int(fraction * 16 * MIB) // block and row["model_bytes"] == row["num_blocks"] * block
        )
        assert row["outcome"] == "ran" and row["steps_done"] == 2 and row["step_s"] > 0
        allocs = fake.ops("managed_alloc")
        if mode == "caches":
            assert fake.calls == [] and row["expect"] == ("oom" if preset().unified else "run")
        elif mode == "frozen_weights":
            assert sum(c.nbytes for c in allocs) == row["model_bytes"] == row["pool_bytes"]  # frozen only
            assert len(fake.ops("new_stream")) == 1 and fake.ops("prefetch")  # the prefetcher ran
            assert row["force"] is (not preset().unified)
        else:
            assert allocs == [] and len(fake.ops("route_all")) == 1
            assert fake.routed_limit <= row["cap_bytes"]
            assert fake.routed_limit == int(row["oversubscription_ratio"] * 16 * MIB)
    assert rows["frozen_weights"]["plan"]["mode"] == "frozen_weights"


def test_a_mode_the_machine_cannot_back_is_refused_before_allocating(tmp_path):
    fake = _small(discrete_info)
    path = tmp_path / "row.json"
    gpu_check_workers.mode_worker("frozen_weights", path, 1, 1.0, width=256, tokens=8, runtime=fake, device="cpu")
    row = json.loads(path.read_text())
    assert row["outcome"] == "refused" and "lower --hbm-fraction" in row["reason"] and fake.calls == []

    fake = _small(gh200_info)
    fake.routing = "this PyTorch has no torch._C._cuda_beginAllocateToPool"
    gpu_check_workers.mode_worker("all", path, 1, None, width=256, tokens=8, runtime=fake, device="cpu")
    row = json.loads(path.read_text())
    assert row["outcome"] == "refused" and "_cuda_beginAllocateToPool" in row["reason"]
    assert fake.calls == []


# --- the MFU benchmark ------------------------------------------------------------------------------------
def test_summarize_takes_medians_after_warmup_and_says_unknown():
    rows = [
        {"step": 1, "samples_per_s": 1.0, "step_time_s": 9.0},
        {"step": 2, "samples_per_s": 10.0, "step_time_s": 0.4, "mfu": 0.3},
        {"step": 3, "samples_per_s": 30.0, "step_time_s": 0.2, "mfu": 0.5},
        {"step": 4, "samples_per_s": 20.0, "step_time_s": 0.3, "mfu": None},
    ]
    got = bench_mfu.summarize(rows, warmup=1)
    assert got["steps_measured"] == 3 and got["samples_per_s"] == 20.0 and got["step_time_s"] == 0.3
    assert got["mfu"] == 0.4 and got["tflops"] == "unknown"


def _session(tmp_path, **profile):
    machine = {**MACHINE, "device": {**gh200_info().as_dict(), "free_bytes": 90 * GIB}}
    machine["host"] = {"ram_total_bytes": 24 * GIB, "ram_available_bytes": 20 * GIB}
    return gpu_check.Session(tmp_path, {**gpu_check.PROFILES["quick"], **profile}, time.monotonic() + 300, machine)


def test_the_mfu_check_runs_bench_mfu_through_the_real_trainer_on_cpu(tmp_path):
    config = bench_mfu.write_bench_config(tmp_path / "work", "tiny", batch_size=2, mixed_precision="no")
    s = _session(tmp_path, mfu_steps=3)
    result = s.record(gpu_check.check_mfu(s, config, None))
    assert result.status == "passed", result.reason
    bench = result.details
    assert bench["status"] == "ok" and bench["steps_measured"] == 1 and bench["warmup"] == 2
    assert bench["batch_size"] == 4 and bench["mixed_precision"] == "bf16"  # the bench's defaults, set on the run
    assert result.figures["mfu"] == "unknown" and result.figures["peak_memory_gib"] == "unknown"  # no GPU
    assert result.figures["samples_per_s"] > 0 and result.figures["step_time_s"] > 0
    lines = (tmp_path / "model_work" / "mfu-output" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| mfu | passed | mfu unknown; tflops " in md


def test_the_diagnostic_check_passes_the_bounded_scale_and_records_what_the_diagnostic_said(tmp_path):
    s = _session(tmp_path)
    result = gpu_check.check_diagnostic(s)
    assert result.command.endswith("gh200_diagnostic.py --json --oversubscription-scale 0.91")  # 0.8 x 110 / 96
    assert result.status == "skipped" and result.reason.startswith("needs managed memory on a CUDA device")
    assert result.figures == {"scale": 0.91, "expected": "run"}


def test_no_time_left_skips_a_check_without_running_it(tmp_path):
    s = _session(tmp_path)
    s.deadline = time.monotonic() + 5
    result = gpu_check.check_gpu_tests(s)
    assert (result.status, result.reason) == ("skipped", "out of time budget")
    assert not (tmp_path / "gpu_tests.log").exists()


def test_the_all_worker_runs_with_the_allocator_settings_of_a_training_run():
    assert gpu_check.all_mode_alloc_conf() == "max_split_size_mb:256,release_lock_on_cudamalloc:True"


def test_the_managed_cap_counts_a_numa_node_hbm_once():
    info, free, host = gh200_info(), 90 * GIB, 400 * GIB
    cdmm = gpu_check.managed_cap(info, free, host, memory_only_numa_bytes=0)
    numa = gpu_check.managed_cap(info, free, host, memory_only_numa_bytes=95 * GIB)
    assert cdmm == int(0.8 * (host + free)) and numa == int(0.8 * host)
