"""gh200_optimizations.managed_memory: what each mode is allowed to do where, the managed pool's
bound, and a run that takes its frozen weights from the managed pool, on CPU against the
recording fake runtime (tests/fake_cuda.py). The placement and prefetch themselves:
test_managed_weights.py; the estimator's per-mode budgets: test_memory_managed_modes.py."""

from __future__ import annotations

import logging
import threading

import orjson
import pytest
from fake_cuda import GIB, FakeRuntime, discrete_info, gb10_info
from training_helpers import train

from simpletuner.configuration import ConfigError, load_config, validate_config
from simpletuner.gh200.managed_memory import (
    RESERVE_FRACTION,
    ManagedMemoryPlan,
    check_managed_memory,
    managed_memory_problems,
    start_managed_memory,
)
from simpletuner.hardware.managed_pool import PoolAccount
from simpletuner.hardware.runtime import NoCudaRuntime, use_runtime

HOST = 400 * GIB  # MemAvailable of a GH200's Grace side, give or take
HBM = 96 * GIB  # fake_cuda.gh200_info()


@pytest.fixture
def config(make_config, tmp_path):
    """A validated config of the tiny model with ``gh200_optimizations`` (and any other key) set."""

    def _make(gh200=None, **overrides):
        raw = make_config(gh200_optimizations=gh200 or {}, **overrides)
        return validate_config(raw)

    return _make


# --- the pool's accounting ---------------------------------------------------------------------


def test_pool_account_reserves_up_to_the_limit_and_refuses_beyond():
    account = PoolAccount(limit_bytes=100)
    assert account.reserve(60) and account.reserve(40)
    account.allocated(0x1000, 60)
    account.allocated(0x2000, 40)
    assert not account.reserve(1)
    assert account.as_dict() == {
        "limit_bytes": 100,
        "allocated_bytes": 100,
        "peak_bytes": 100,
        "num_allocations": 2,
        "num_refused": 1,
        "largest_refused_bytes": 1,
    }
    account.release(0x1000)
    assert account.allocated_bytes == 40 and account.reserve(60)
    account.cancel(60)  # the cudaMallocManaged behind that reservation failed
    assert account.allocated_bytes == 40 and account.peak_bytes == 100


def test_pool_account_unbounded_until_a_limit_is_set():
    account = PoolAccount()
    assert account.reserve(10**15)
    account.allocated(1, 10**15)
    account.set_limit(10)  # what is held stays; new reservations obey the bound
    assert not account.reserve(1)
    account.release(1)
    assert account.reserve(10)
    with pytest.raises(ValueError, match="must be positive"):
        account.set_limit(0)


def test_pool_account_release_of_an_unknown_pointer_uses_the_size_given():
    account = PoolAccount()
    account.reserve(8)  # allocated before the account recorded pointers
    account.release(0xDEAD, 8)
    assert account.allocated_bytes == 0


def test_pool_account_is_consistent_across_threads():
    account = PoolAccount(limit_bytes=1000)
    granted: list[int] = []
    lock = threading.Lock()

    def worker(base: int) -> None:
        for i in range(200):
            if account.reserve(7):
                account.allocated(base + i, 7)
                with lock:
                    granted.append(base + i)

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(granted) == 1000 // 7 and account.allocated_bytes == 7 * len(granted)
    for ptr in granted:
        account.release(ptr)
    assert account.allocated_bytes == 0 and account.num_refused == 4 * 200 - len(granted)


# --- the checks before anything loads ------------------------------------------------------------


def test_caches_needs_nothing_from_the_runtime(config):
    assert check_managed_memory(config(), NoCudaRuntime()) == ManagedMemoryPlan("caches")


def test_frozen_weights_on_a_gh200(config):
    plan = check_managed_memory(config({"managed_memory": "frozen_weights", "prefetch_blocks_ahead": 2}), FakeRuntime())
    assert plan.mode == "frozen_weights" and plan.places_frozen_weights and plan.prefetch_blocks_ahead == 2
    assert plan.device.startswith("coherent") and not plan.forced and plan.pool_limit_bytes is None


def test_no_managed_memory_is_refused_with_the_runtime_reason(config):
    with pytest.raises(ValueError, match="needs CUDA managed memory, which is unavailable here: no GPU in this test"):
        check_managed_memory(config({"managed_memory": "all"}), NoCudaRuntime("no GPU in this test"), HOST)


@pytest.mark.parametrize("mode", ["frozen_weights", "all"])
def test_a_discrete_gpu_is_refused_without_consent(config, mode):
    runtime = FakeRuntime(info=discrete_info())
    with pytest.raises(ValueError) as err:
        check_managed_memory(config({"managed_memory": mode}), runtime, HOST)
    assert "NVIDIA H100 80GB HBM3, a discrete" in str(err.value) and "force_managed_memory true" in str(err.value)
    plan = check_managed_memory(config({"managed_memory": mode, "force_managed_memory": True}), runtime, HOST)
    assert plan.forced and plan.mode == mode


def test_all_without_a_ratio_takes_what_the_machine_backs_less_the_reserve(config):
    runtime = FakeRuntime(free_bytes=90 * GIB)
    plan = check_managed_memory(config({"managed_memory": "all"}), runtime, HOST)
    backable = HOST + 90 * GIB  # GH200: Grace's available memory plus the free HBM
    assert plan.backable_bytes == backable
    assert plan.pool_limit_bytes == int(backable * (1 - RESERVE_FRACTION))
    assert plan.oversubscription_ratio == round(plan.pool_limit_bytes / HBM, 4)


def test_all_with_a_ratio_bounds_the_pool_at_ratio_times_hbm(config):
    plan = check_managed_memory(config({"managed_memory": "all", "oversubscription_ratio": 2.5}), FakeRuntime(), HOST)
    assert plan.pool_limit_bytes == int(2.5 * HBM) and plan.oversubscription_ratio == 2.5


def test_a_ratio_the_machine_cannot_back_is_refused_with_the_largest_that_fits(config):
    runtime = FakeRuntime(free_bytes=96 * GIB)
    with pytest.raises(ValueError) as err:
        check_managed_memory(config({"managed_memory": "all", "oversubscription_ratio": 5.0}), runtime, HOST)
    most = (HOST + 96 * GIB) * (1 - RESERVE_FRACTION) / HBM
    message = str(err.value)
    assert "oversubscription_ratio 5 bounds the managed pool at 480.0 GiB" in message
    assert (
        "available CPU memory + free GPU memory" in message and f"largest ratio it backs now is {most:.2f}" in message
    )


def test_on_gb10_only_the_one_shared_memory_backs_the_pool(config):
    runtime = FakeRuntime(info=gb10_info(), free_bytes=100 * GIB)
    plan = check_managed_memory(config({"managed_memory": "all"}), runtime, 110 * GIB)
    assert plan.backable_bytes == 110 * GIB  # integrated: the free "GPU memory" is the same memory
    with pytest.raises(ValueError, match=r"\(available memory\)"):
        check_managed_memory(config({"managed_memory": "all", "oversubscription_ratio": 1.0}), runtime, 110 * GIB)


def test_all_refused_when_host_memory_is_unknown(config):
    with pytest.raises(ValueError, match="cannot tell how much memory this machine can back"):
        check_managed_memory(config({"managed_memory": "all"}), FakeRuntime(), None)


def test_all_refused_where_allocations_cannot_be_routed(config):
    runtime = FakeRuntime(routing="this PyTorch has no torch._C._cuda_beginAllocateToPool")
    with pytest.raises(ValueError, match="cannot route every allocation to the managed pool: this PyTorch has no"):
        check_managed_memory(config({"managed_memory": "all"}), runtime, HOST)


def test_all_refuses_allocator_settings_it_cannot_honour_naming_where_they_came_from(config):
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"}
    with pytest.raises(ValueError) as err:
        check_managed_memory(config({"managed_memory": "all"}), FakeRuntime(), HOST, env)
    assert "expandable_segments (set by PYTORCH_CUDA_ALLOC_CONF in the environment)" in str(err.value)
    cfg = config({"managed_memory": "all"}, cuda_allocator={"backend": "cudaMallocAsync"})
    with pytest.raises(ValueError, match=r"backend cudaMallocAsync \(set by cuda_allocator in the config\)"):
        check_managed_memory(cfg, FakeRuntime(), HOST, {})
    # the config's own value wins over the environment's, as knobs.apply_cuda_allocator merges them
    cfg = config({"managed_memory": "all"}, cuda_allocator={"expandable_segments": False})
    assert check_managed_memory(cfg, FakeRuntime(), HOST, env).mode == "all"


def test_frozen_weights_refuses_what_places_the_same_weights_another_way_all_at_once(config):
    cfg = config(
        {"managed_memory": "frozen_weights"}, base_model_precision="qfloat8", low_vram=True, enable_compile=True
    )
    problems, _ = managed_memory_problems(cfg, FakeRuntime(info=discrete_info()))
    assert len(problems) == 4
    assert "base_model_precision qfloat8" in problems[0] and 'managed_memory "all"' in problems[0]
    assert "low_vram" in problems[1] and "enable_compile" in problems[2] and "discrete" in problems[3]
    # without prefetch there are no hooks for torch.compile to trip on
    cfg = config({"managed_memory": "frozen_weights", "prefetch_blocks_ahead": 0}, enable_compile=True)
    assert check_managed_memory(cfg, FakeRuntime()).prefetch_blocks_ahead == 0


def test_a_ratio_without_mode_all_is_a_config_error(make_config, tmp_path):
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(make_config(gh200_optimizations={"oversubscription_ratio": 2.0})))
    with pytest.raises(ConfigError, match='oversubscription_ratio 2 bounds the managed pool of managed_memory "all"'):
        load_config(str(path))


def test_start_routes_every_allocation_only_for_all(config, caplog):
    runtime = FakeRuntime()
    start_managed_memory(check_managed_memory(config({"managed_memory": "frozen_weights"}), runtime), runtime)
    assert runtime.ops("route_all") == []
    plan = check_managed_memory(config({"managed_memory": "all", "oversubscription_ratio": 1.5}), runtime, HOST)
    caplog.set_level(logging.INFO, logger="simpletuner.gh200.managed_memory")
    start_managed_memory(plan, runtime)
    assert [c.nbytes for c in runtime.ops("route_all")] == [int(1.5 * HBM)]
    assert "every CUDA allocation comes from the managed pool, bounded at 144.0 GiB (1.50 x" in caplog.text


def test_forced_modes_warn_at_start(config, caplog):
    runtime = FakeRuntime(info=discrete_info())
    plan = check_managed_memory(config({"managed_memory": "frozen_weights", "force_managed_memory": True}), runtime)
    with caplog.at_level(logging.WARNING, logger="simpletuner.gh200.managed_memory"):
        start_managed_memory(plan, runtime)
    assert "force_managed_memory: managed_memory frozen_weights on a discrete" in caplog.text


# --- a run -----------------------------------------------------------------------------------------


def test_a_frozen_weights_run_trains_with_its_base_in_managed_memory(make_config, tmp_path, fake_runtime):
    raw = make_config(max_train_steps=2, gh200_optimizations={"managed_memory": "frozen_weights"})
    trainer, result = train(raw)
    assert result.global_step == 2 and all(loss == loss for loss in result.losses)
    model = trainer.accelerator.unwrap_model(trainer.model)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert frozen and trainable
    assert all(fake_runtime.is_managed(p) for p in frozen)  # the base: from the managed pool
    assert not any(fake_runtime.is_managed(p) for p in trainable)  # the adapter: ordinary memory
    advised = {(c.ptr, c.detail, c.location) for c in fake_runtime.ops("advise")}
    for p in frozen:
        ptr = p.untyped_storage().data_ptr()
        assert {(ptr, "preferred_location", "cpu"), (ptr, "accessed_by", 0)} <= advised
    recorded = orjson.loads((tmp_path / "output" / "gh200_runtime.json").read_bytes())
    assert recorded["managed_memory"]["mode"] == "frozen_weights"
    assert recorded["managed_memory"]["prefetch_blocks_ahead"] == 1
    # from the second step on, blocks were prefetched to the GPU ahead of their forward
    assert any(c.location == 0 for c in fake_runtime.ops("prefetch"))


def test_train_refuses_a_mode_this_machine_cannot_do_before_loading_anything(make_config, tmp_path, capsys):
    from simpletuner.cli.train import main

    raw = make_config(gh200_optimizations={"managed_memory": "frozen_weights"})
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    with use_runtime(NoCudaRuntime("no CUDA device (torch.cuda.is_available() is False)")):
        code = main(["--config", str(path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "managed_memory 'frozen_weights' needs CUDA managed memory" in err and 'managed_memory "caches"' in err
    out = tmp_path / "output"
    assert not (out / "gh200_runtime.json").exists() and not list(out.glob("checkpoint-*"))


def test_the_log_shows_the_bounded_pools_peak_and_bound():
    from simpletuner.training.metrics import uvm_memory_figures

    assert uvm_memory_figures(None) == {}
    assert uvm_memory_figures({"reserved_bytes": 2 * GIB}) == {"managed_pool_gib": 2.0}
    bounded = {"reserved_bytes": 2 * GIB, "peak_bytes": 3 * GIB, "limit_bytes": 4 * GIB}
    assert uvm_memory_figures(bounded) == {
        "managed_pool_gib": 2.0,
        "managed_pool_peak_gib": 3.0,
        "managed_pool_limit_gib": 4.0,
    }
