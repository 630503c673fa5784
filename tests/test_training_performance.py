"""Performance knobs and throughput figures: fakes for the CUDA pieces, real training runs for the rest."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import orjson
import pytest
import torch
from safetensors.torch import load_file

from simpletuner.caching import ShardedTensorStore, TensorCache
from simpletuner.configuration import ConfigError, validate_config
from simpletuner.memory.estimator import build_meta_denoiser
from simpletuner.precision import resolve_mixed_precision, run_dtype
from simpletuner.state import StateTracker
from simpletuner.training import knobs, metrics
from simpletuner.training.trainer import Trainer


class FakeCuda:
    """What the knobs ask of ``torch.cuda``; records peak-memory resets."""

    def __init__(self, available=True, bf16=True, initialized=False, peak=3 * 2**30):
        self.available, self.bf16, self.initialized, self.peak, self.resets = available, bf16, initialized, peak, 0

    def is_available(self):
        return self.available

    def is_bf16_supported(self):
        return self.bf16

    def get_device_name(self):
        return "Tesla V100-SXM2-32GB"

    def is_initialized(self):
        return self.initialized

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.resets += 1


def test_bf16_falls_back_to_fp16_where_unsupported(caplog):
    caplog.set_level(logging.WARNING)
    assert resolve_mixed_precision("bf16", FakeCuda(bf16=False)) == "fp16"
    assert "not supported by Tesla V100" in caplog.text
    assert resolve_mixed_precision("bf16", FakeCuda(bf16=True)) == "bf16"
    assert resolve_mixed_precision("bf16", FakeCuda(available=False)) == "bf16"  # CPU autocast has bf16
    assert resolve_mixed_precision("no", FakeCuda(bf16=False)) == "no"


def test_run_dtype_is_the_one_mapping_with_the_fallback_and_the_estimate_asks_for_none(
    make_config, caplog, monkeypatch
):
    config = validate_config(make_config(mixed_precision="bf16"))
    assert run_dtype(config, FakeCuda(bf16=False)) == torch.float16  # the trainer's and `cache`'s dtype
    assert run_dtype(config, FakeCuda(bf16=True)) == torch.bfloat16
    caplog.clear()
    assert run_dtype(config, cuda=None) == torch.bfloat16  # the estimate: the target GPU's, this one unasked
    assert not caplog.records
    # the estimator never asks this machine's GPU: a V100 here does not turn an estimate's bf16 into fp16
    v100 = FakeCuda(bf16=False)
    for name in ("is_available", "is_bf16_supported", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, getattr(v100, name))
    assert run_dtype(config) == torch.float16  # what the trainer would now take on this machine
    caplog.clear()
    assert build_meta_denoiser(config).dtype == torch.bfloat16
    assert not [r for r in caplog.records if "not supported" in r.getMessage()]


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_switch(enabled):
    backends = SimpleNamespace(
        cuda=SimpleNamespace(matmul=SimpleNamespace(allow_tf32=None)), cudnn=SimpleNamespace(allow_tf32=None)
    )
    knobs.apply_tf32(enabled, backends)
    assert backends.cuda.matmul.allow_tf32 is enabled and backends.cudnn.allow_tf32 is enabled


def test_allocator_settings_merge_into_the_environment(caplog):
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:False"}
    caplog.set_level(logging.INFO)
    value = knobs.apply_cuda_allocator(
        {"expandable_segments": True, "garbage_collection_threshold": 0.8}, env, FakeCuda()
    )
    assert (
        value
        == env["PYTORCH_CUDA_ALLOC_CONF"]
        == "max_split_size_mb:128,expandable_segments:True,garbage_collection_threshold:0.8"
    )
    assert "overrides False from the environment" in caplog.text
    assert knobs.apply_cuda_allocator({}, env, FakeCuda()) == value  # nothing asked: untouched


def test_allocator_settings_after_cuda_started_are_reported(caplog):
    env: dict[str, str] = {}
    knobs.apply_cuda_allocator({"expandable_segments": True}, env, FakeCuda(initialized=True))
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "after CUDA started" in caplog.text


def test_unknown_allocator_key_is_a_config_error(make_config):
    with pytest.raises(ConfigError) as info:
        validate_config(make_config(cuda_allocator={"use_uvm": True}))
    assert any(
        p.startswith("cuda_allocator") and "use_uvm not accepted" in p and "expandable_segments" in p
        for p in info.value.problems
    ), info.value.problems


def test_throughput_window_figures():
    cuda = FakeCuda()
    meter = metrics.ThroughputWindow(peak_tflops=100.0, flops_per_sample=5e12, cuda=cuda)
    with meter.data_wait():
        pass
    meter.step_done(4)
    meter.step_done(4)
    meter.waited = 0.5  # pin the measured parts so the arithmetic is checkable
    meter.started -= 2.0
    figures = meter.report()
    elapsed = 8 / figures["samples_per_s"]
    assert elapsed == pytest.approx(2.0, abs=0.05)
    assert figures["step_time_s"] == pytest.approx(elapsed / 2)
    assert figures["data_wait_share"] == pytest.approx(0.5 / elapsed)
    assert figures["tflops"] == pytest.approx(5e12 * 8 / elapsed / 1e12)
    assert figures["mfu"] == pytest.approx(figures["tflops"] / 100.0)
    assert figures["peak_memory_gib"] == 3.0 and cuda.resets == 1
    assert (meter.steps, meter.samples, meter.waited) == (0, 0, 0.0)  # next window starts empty
    assert "mfu" not in metrics.ThroughputWindow(flops_per_sample=1.0).report()  # peak unknown: no MFU


def test_count_flops_matches_a_matmul():
    count = metrics.FlopCount()
    with metrics.count_flops(count):
        torch.randn(4, 8) @ torch.randn(8, 16)
    assert count.total == 2 * 4 * 8 * 16


def _train(raw):
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    return trainer, trainer.train()


def test_trainer_logs_throughput_flops_and_a_repeatable_eval_loss(make_config, caplog):
    caplog.set_level(logging.INFO, logger="simpletuner.training.trainer")
    trainer, result = _train(make_config(max_train_steps=4, logging_steps=2, eval_steps=2, eval_iters=2))
    logs = trainer.last_logs
    assert {"loss", "lr", "samples_per_s", "step_time_s", "data_wait_share", "tflops", "eval_loss"} <= set(logs)
    assert "mfu" not in logs  # no GPU, so no peak to compare with
    assert 0 <= logs["data_wait_share"] < 1 and logs["tflops"] > 0
    assert len(trainer.eval_batches) == 2
    assert trainer.eval_loss() == trainer.eval_loss()  # fixed batches, noise and timesteps
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    # On CPU the tiny model's TFLOPS would read "0.00": left out of the line (kept in last_logs / metrics.jsonl).
    assert len(lines) == 2 and all("data wait" in line and "TFLOPS" not in line for line in lines)
    assert "eval_loss" in lines[-1]
    assert sum("FLOPs per sample" in r.getMessage() for r in caplog.records) == 1


def test_flops_are_counted_once_per_model_adapter_and_shape_and_read_by_later_launches(
    make_config, tmp_path, monkeypatch
):
    counted = []
    count = metrics.flops_per_sample
    monkeypatch.setattr(metrics, "flops_per_sample", lambda *a, **k: counted.append(1) or count(*a, **k))

    def setup(**config):
        raw = make_config(output_dir=str(tmp_path / f"out{len(counted)}-{config}"), **config)
        trainer = Trainer(StateTracker(validate_config(raw), raw))
        trainer.setup()
        return trainer.flops_per_sample

    first = setup()
    assert counted == [1] and first > 0
    # another learning rate, schedule and step count: the same pass, read from the cache folder (another seed
    # may draw a micro-batch of another bucket, whose shape is keyed)
    assert setup(learning_rate=1e-3, lr_warmup_steps=3, max_train_steps=9) == first and counted == [1]
    kept = tmp_path / "cache" / metrics.FLOPS_FILE
    assert kept.is_file() and list(orjson.loads(kept.read_bytes()).values()) == [first]
    rank = validate_config(make_config()).lora_rank
    other = setup(lora_rank=rank * 2)  # another adapter: counted again, with more FLOPs
    assert counted == [1, 1] and other > first
    assert setup(train_batch_size=1) == pytest.approx(first) and len(counted) == 3  # another shape: counted
    # a cache folder where the file cannot be written or read: counted each time, the run goes on
    kept.unlink()
    kept.mkdir()
    assert setup(lora_rank=2) > 0 and setup(lora_rank=2) > 0 and len(counted) == 5


def _mfu_run(make_config, tmp_path, name, hardware=None, peak_tflops=None, **config):
    raw = make_config(max_train_steps=2, logging_steps=1, output_dir=str(tmp_path / name), **config)
    trainer = Trainer(StateTracker(validate_config(raw), raw), hardware=hardware, peak_tflops=peak_tflops)
    trainer.train()
    records = [orjson.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_bytes().splitlines()]
    return trainer, records


@pytest.mark.parametrize(
    "precision, tf32, peak, kind",
    [("no", True, 494.7, "TF32 tensor-core"), ("no", False, 67.0, "FP32"), ("bf16", True, 989.4, "bf16 tensor-core")],
)
def test_mfu_uses_the_peak_of_the_runs_precision(make_config, tmp_path, caplog, precision, tf32, peak, kind):
    # CUDA cannot exist here: the run is real, the GPU it is measured against (an H100 SXM) is injected.
    from simpletuner.hardware.machine import hardware_for_gpu

    caplog.set_level(logging.INFO, logger="simpletuner")
    trainer, records = _mfu_run(
        make_config, tmp_path, "h100", hardware=hardware_for_gpu("h100"), mixed_precision=precision, enable_tf32=tf32
    )
    logs = trainer.last_logs
    assert logs["mfu"] == pytest.approx(logs["tflops"] / peak)
    assert [m["mfu"] == pytest.approx(m["tflops"] / peak) for m in records] == [True, True]  # grep mfu metrics.jsonl
    said = [r.getMessage() for r in caplog.records if "MFU is measured against" in r.getMessage()]
    assert said == [
        f"MFU is measured against {peak:g} TFLOPS, the H100 SXM's dense {kind} peak (--peak-tflops overrides it)"
    ]


def test_a_gpu_not_in_the_table_says_peak_unknown_once(make_config, tmp_path, caplog):
    from fake_cuda import FakeRuntime

    from simpletuner.hardware.machine import detect_hardware
    from simpletuner.hardware.runtime import DeviceMemoryInfo

    mystery = DeviceMemoryInfo(0, "NVIDIA Mystery 9000", (9, 0), 48 * 2**30, True, True, False, False, False)
    hardware = detect_hardware(FakeRuntime(info=mystery), meminfo_path=str(tmp_path / "no-meminfo"))
    caplog.set_level(logging.INFO, logger="simpletuner")
    trainer, records = _mfu_run(make_config, tmp_path, "mystery", hardware=hardware)
    unknown = [r for r in caplog.records if "peak unknown: pass --peak-tflops" in r.getMessage()]
    assert len(unknown) == 1 and unknown[0].levelno == logging.WARNING
    assert "NVIDIA Mystery 9000 is not in the GPU table" in unknown[0].getMessage()
    assert "mfu" not in trainer.last_logs and all("mfu" not in m and m["tflops"] > 0 for m in records)
    assert "WARNING simpletuner.training.metrics: MFU left out: peak unknown: pass --peak-tflops" in (
        tmp_path / "mystery" / "training.log"
    ).read_text(encoding="utf-8")


def test_peak_tflops_flag_overrides_the_table(make_config, tmp_path):
    from simpletuner.hardware.machine import hardware_for_gpu

    trainer, _ = _mfu_run(make_config, tmp_path, "flag", hardware=hardware_for_gpu("h100"), peak_tflops=0.5)
    assert trainer.last_logs["mfu"] == pytest.approx(trainer.last_logs["tflops"] / 0.5)


def test_peak_tflops_on_the_command_line(make_config, tmp_path, capsys):
    from simpletuner.cli import main

    root, ours = logging.getLogger(), logging.getLogger("simpletuner")
    saved = root.level, list(root.handlers), ours.level
    config = tmp_path / "cfg.json"
    config.write_bytes(orjson.dumps(make_config(max_train_steps=2, logging_steps=1)))
    try:
        assert main(["train", "--config", str(config), "--peak-tflops", "0.25"]) == 0  # CPU: no table peak at all
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        ours.setLevel(saved[2])
    out = tmp_path / "output"
    assert all(
        m["mfu"] == pytest.approx(m["tflops"] / 0.25)
        for m in map(orjson.loads, (out / "metrics.jsonl").read_bytes().splitlines())
    )
    assert "MFU is measured against 0.25 TFLOPS (--peak-tflops)" in (out / "training.log").read_text(encoding="utf-8")
    for bad in ("0", "-3", "fast"):
        with pytest.raises(SystemExit):
            main(["train", "--config", str(config), "--peak-tflops", bad])
        assert "expected a positive number of TFLOPS" in capsys.readouterr().err


def test_flop_counting_and_eval_do_not_change_training(make_config, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_flops_per_sample", lambda self, model, samples: None)  # no counting pass at all
        plain_trainer, plain = _train(make_config(max_train_steps=3, output_dir=str(tmp_path / "a")))
    assert "tflops" not in plain_trainer.last_logs
    _, measured = _train(
        make_config(max_train_steps=3, output_dir=str(tmp_path / "b"), eval_steps=1, eval_iters=1, logging_steps=1)
    )
    assert plain.losses == measured.losses
    a, b = load_file(plain.output_path), load_file(measured.output_path)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_loader_threads_give_the_same_latents(make_config, tmp_path):
    def latents(workers, name):
        trainer = Trainer(
            StateTracker(
                validate_config(
                    raw := make_config(
                        max_train_steps=1,
                        dataloader_num_workers=workers,
                        output_dir=str(tmp_path / name),
                        cache_config={"cache_dir": str(tmp_path / name / "cache")},
                    )
                ),
                raw,
            )
        )
        trainer.setup()
        store = trainer.data.vae_cache.store
        return {k: store.get(k)["latents"] for k in store.keys()}

    inline, threaded = latents(0, "inline"), latents(2, "threaded")
    assert inline.keys() == threaded.keys() and len(inline) > 0
    assert all(torch.equal(inline[k], threaded[k]) for k in inline)


def test_fill_prepares_ahead_in_order_and_stops_on_errors(tmp_path):
    cache = TensorCache(ShardedTensorStore(tmp_path / "s"), "vae")
    items = [(f"k{i}", i) for i in range(10)]
    seen = []

    def prepare(payloads):
        return [p * 10 for p in payloads]

    def compute(prepared):
        seen.append(prepared)
        return [{"x": torch.tensor([v])} for v in prepared]

    report = cache.fill(items, compute, batch_size=3, prepare=prepare, prepare_workers=2)
    assert report.num_computed == 10
    assert seen == [[0, 10, 20], [30, 40, 50], [60, 70, 80], [90]]
    assert cache.get("k7")["x"].item() == 70

    def broken(payloads):
        raise OSError("disk went away")

    other = TensorCache(ShardedTensorStore(tmp_path / "t"), "vae")
    with pytest.raises(OSError, match="disk went away"):
        other.fill(items, compute, batch_size=3, prepare=broken, prepare_workers=2)


def test_compile_knob_compiles_the_denoiser(make_config, monkeypatch):
    # The eager backend runs the real torch.compile front end (Dynamo) without a C++ build.
    calls = []
    real = torch.compile

    def recording(model, **kwargs):
        calls.append(type(model).__name__)
        return real(model, backend="eager")

    monkeypatch.setattr(torch, "compile", recording)
    # One step: a second would come from another aspect bucket, and Dynamo would trace the UNet again (~10 s)
    # for shapes that are torch's business, not the knob's.
    trainer, result = _train(make_config(max_train_steps=1, enable_compile=True))
    assert calls == ["UNet2DConditionModel"]
    assert result.global_step == 1 and all(torch.isfinite(torch.tensor(result.losses)))
    assert "tflops" not in trainer.last_logs  # the FLOP counter is skipped under compile
    assert result.output_path.is_file()
