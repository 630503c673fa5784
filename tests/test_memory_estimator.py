"""The memory estimator: exact counts against a real model, activations against a real CPU step."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from simpletuner.configuration import validate_config
from simpletuner.memory.estimator import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    CUDNN_WORKSPACE_BYTES,
    GiB,
    build_meta_denoiser,
    estimate_memory,
    flops_per_step,
    trace_activations,
)
from simpletuner.memory.measure import measure_cpu_step
from simpletuner.models import get_model_spec
from simpletuner.models.adapters import prepare_for_training
from simpletuner.testing.config_only import write_sd15_config_only
from simpletuner.training.optim import build_optimizer

_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture
def config(make_config):
    return lambda **kw: validate_config(make_config(**kw))


def _real_counts(cfg) -> dict[str, int]:
    """Bytes of a real model built by the trainer's own calls, after one real step and one
    optimizer step: parameters, trainable parameters, gradients and optimizer state as they are."""
    spec = get_model_spec(cfg)
    dtype = _DTYPES[cfg.mixed_precision]
    model = spec.load_denoiser(dtype if cfg.training_type == "lora" else torch.float32)
    if cfg.training_type == "lora":
        model = prepare_for_training(model, spec.lora_targets, cfg, dtype)
    else:
        model.requires_grad_(True)
    optimizer = build_optimizer(cfg, model.parameters())
    if cfg.mixed_precision == "fp16":  # no fp16 compute on CPU: gradients of the right shape suffice
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    else:
        from simpletuner.memory.estimator import batch_shapes

        latents, cond = batch_shapes(cfg, 1)
        gen = torch.Generator().manual_seed(0)
        with torch.autocast("cpu", dtype=dtype, enabled=cfg.mixed_precision != "no"):
            loss = spec.training_loss(
                model, torch.randn(latents.shape), {k: torch.randn(s.shape).to(s.dtype) for k, s in cond.items()}, gen
            )
        loss.sum().backward()
    optimizer.step()
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.ndim > 0]
    return {
        "weights": sum(p.nbytes for p in params) + sum(b.nbytes for b in model.buffers()),
        "trainable_weights": sum(p.nbytes for p in params if p.requires_grad),
        "gradients": sum(p.grad.nbytes for p in params if p.grad is not None),
        "optimizer_state": sum(t.nbytes for t in state),  # scalar `step` counters live on the CPU
        "num_parameters": sum(p.numel() for p in params),
    }


@pytest.mark.parametrize(
    "overrides",
    [
        {"training_type": "full", "mixed_precision": "no", "optimizer": "adamw"},
        {"training_type": "lora", "mixed_precision": "no", "optimizer": "adamw"},
        {"training_type": "lora", "mixed_precision": "bf16", "optimizer": "adamw"},
        {"training_type": "lora", "mixed_precision": "fp16", "optimizer": "adam"},
        {"training_type": "lora", "mixed_precision": "bf16", "optimizer": "sgd", "lora_rank": 4},
        {"training_type": "full", "mixed_precision": "bf16", "optimizer": "sgd"},
    ],
    ids=[
        "full-fp32-adamw",
        "lora-fp32-adamw",
        "lora-bf16-adamw",
        "lora-fp16-adam",
        "lora-bf16-sgd-r4",
        "full-bf16-sgd",
    ],
)
def test_exact_counts_match_a_real_model(config, overrides):
    cfg = config(**overrides)
    est = estimate_memory(cfg, device_kind="cpu")
    real = _real_counts(cfg)
    assert est.weights == real["weights"]
    assert est.trainable_weights == real["trainable_weights"]
    assert est.gradients == real["gradients"]
    assert est.optimizer_state == real["optimizer_state"]
    assert est.num_parameters == real["num_parameters"]
    assert est.trainable_dtype == "float32"
    assert est.weight_dtype == (
        "float32" if overrides["training_type"] == "full" else str(_DTYPES[overrides["mixed_precision"]])[6:]
    )


# The real step is measured with torch.profiler (profile_memory=True): the CPU allocator's own
# running total, not MemTracker, over real tensors and weights set up by the trainer's calls
# (load_denoiser, prepare_for_training, Accelerator.prepare's autocast). Both sides count the same thing:
# bytes allocated during loss + backward above what existed before it (parameters and the batch),
# minus the gradients alive at the peak. The profiler also sees what no tensor-level trace can
# (allocations inside kernels, host-side RNG states saved by checkpointing: ~5 KB per block),
# which is why the comparison has a tolerance; on this model those are 0-5% of activations.
@pytest.mark.parametrize(
    "overrides, batch",
    [
        ({"mixed_precision": "no"}, 2),
        ({"mixed_precision": "bf16"}, 2),
        ({"mixed_precision": "bf16", "gradient_checkpointing": True}, 4),
        ({"mixed_precision": "no", "gradient_checkpointing": True}, 2),
        ({"training_type": "full", "mixed_precision": "no"}, 2),
        ({"training_type": "full", "mixed_precision": "no"}, 8),
    ],
    ids=["lora-fp32", "lora-bf16", "lora-bf16-ckpt", "lora-fp32-ckpt", "full-fp32-b2", "full-fp32-b8"],
)
def test_activations_within_10_percent_of_a_real_cpu_step(config, overrides, batch):
    cfg = config(**overrides)
    est = estimate_memory(cfg, batch, device_kind="cpu")
    real = measure_cpu_step(cfg, batch)
    assert real.activations > 0
    assert abs(est.activations - real.activations) <= 0.10 * real.activations, (est.activations, real)
    assert abs(est.backward_peak - real.peak) <= 0.10 * real.peak, (est.backward_peak, real)


def test_activations_scale_about_linearly_with_batch(config):
    cfg = config(mixed_precision="no")
    acts = {b: trace_activations(cfg, b)[0] for b in (1, 2, 4)}
    assert 1.8 <= acts[2] / acts[1] <= 2.2
    assert 1.8 <= acts[4] / acts[2] <= 2.2
    # Affine in the batch: equal increments for equal steps.
    assert acts[4] - acts[2] == pytest.approx(2 * (acts[2] - acts[1]), rel=0.05)
    est = estimate_memory(cfg, 4, device_kind="cpu")
    assert est.micro_batch_size == 4 and est.latent_shape == (4, 8, 8)
    assert est.batch_data == 4 * (4 * 8 * 8 * 4 + 77 * 32 * 4)  # fp32 latents + fp32 CLIP embeddings


def test_gradient_checkpointing_lowers_activations(config):
    plain = estimate_memory(config(mixed_precision="bf16"), 4)
    ckpt = estimate_memory(config(mixed_precision="bf16", gradient_checkpointing=True), 4)
    assert ckpt.gradient_checkpointing and not plain.gradient_checkpointing
    assert ckpt.activations < 0.8 * plain.activations
    assert ckpt.total < plain.total
    assert ckpt.weights == plain.weights


def test_breakdown_adds_up_and_table_renders(config):
    est = estimate_memory(config(mixed_precision="bf16", optimizer="adam"))
    parts = (
        est.weights
        + est.gradients
        + est.optimizer_state
        + est.activations
        + est.optimizer_transient
        + est.not_live_at_once
        + est.batch_data
        + est.framework_overhead
    )
    assert parts == est.total
    assert est.not_live_at_once <= 0
    assert est.framework_overhead == est.cuda_context + est.workspaces + est.fragmentation
    assert est.cuda_context == CUDA_CONTEXT_BYTES
    assert est.workspaces == CUBLAS_WORKSPACE_BYTES + CUDNN_WORKSPACE_BYTES  # the UNet has convolutions

    usable = 2 * GiB
    assert est.headroom(usable) == usable - est.total
    assert est.headroom(est.total // 2) < 0
    text = est.table(usable)
    for word in (
        "weights",
        "gradients",
        "optimizer state",
        "activations",
        "batch data",
        "framework overhead",
        "total",
        "headroom",
    ):
        assert word in text
    assert f"{est.total / GiB:.2f}" in text
    assert f"{est.headroom(usable) / GiB:.2f}" in text
    assert f"{100 * est.headroom(usable) / usable:.1f}%" in text
    assert "headroom" not in est.table()
    assert "lora r16 (adam)" in text and "micro-batch 2 at 64px" in text and "bfloat16" in text

    d = est.as_dict()
    assert json.loads(json.dumps(d))["total"] == est.total
    assert d["latent_shape"] == [4, 8, 8] and d["optimizer"] == "adam"


def test_cpu_device_has_no_cuda_overhead(config):
    cfg = config()
    cpu = estimate_memory(cfg, device_kind="cpu")
    cuda = estimate_memory(cfg, device_kind="cuda")
    assert cpu.cuda_context == 0 and cpu.workspaces == 0
    assert cpu.framework_overhead == cpu.fragmentation
    assert cuda.total - cpu.total == CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + CUDNN_WORKSPACE_BYTES
    with pytest.raises(ValueError, match="device_kind"):
        estimate_memory(cfg, device_kind="tpu")
    with pytest.raises(ValueError, match="batch_size"):
        estimate_memory(cfg, 0)


def test_full_finetune_counts_optimizer_temporaries(config):
    est = estimate_memory(config(training_type="full", optimizer="adamw"), 1)
    # foreach AdamW on CUDA: one full-size sqrt(exp_avg_sq) list while the optimizer steps.
    assert est.optimizer_transient == est.trainable_weights
    assert est.total >= est.weights + est.gradients + est.optimizer_state + est.optimizer_transient


def test_no_real_parameter_memory(config, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = config(mixed_precision="bf16")
    model = build_meta_denoiser(cfg)
    assert all(p.device.type == "meta" for p in model.parameters())
    trace_activations(cfg, 2, model)
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    assert not torch.cuda.is_initialized()


def test_flops_match_a_real_step(config):
    from torch.utils.flop_counter import FlopCounterMode

    cfg = config(mixed_precision="no")
    est = flops_per_step(cfg, 2)
    spec = get_model_spec(cfg)
    model = prepare_for_training(spec.load_denoiser(torch.float32), spec.lora_targets, cfg, torch.float32)
    counter = FlopCounterMode(display=False)
    with counter:
        loss = spec.training_loss(
            model, torch.randn(2, 4, 8, 8), {"prompt_embeds": torch.randn(2, 77, 32)}, torch.Generator()
        )
        (loss.sum() / 2).backward()
    assert est == counter.get_total_flops() > 0
    assert flops_per_step(cfg, 4) == pytest.approx(2 * est, rel=0.05)


def test_sd15_config_only_estimate_in_a_fresh_process(tmp_path):
    """The SD1.5-size estimate runs from configs alone, with CUDA hidden, well below the UNet's
    3.2 GiB of fp32 weights in resident memory (nothing real is allocated for parameters)."""
    folder = write_sd15_config_only(tmp_path / "sd15")
    assert not list(folder.rglob("*.safetensors")) and not list(folder.rglob("*.bin"))
    (tmp_path / "data").mkdir()
    script = textwrap.dedent(f"""
        import json, resource, torch
        from simpletuner.configuration import validate_config
        from simpletuner.memory.estimator import estimate_memory
        cfg = validate_config({{"pretrained_model_name_or_path": {str(folder)!r}, "max_train_steps": 1,
                                "datasets": [{{"id": "d", "type": "local",
                                              "instance_data_dir": {str(tmp_path / "data")!r}}}],
                                "mixed_precision": "bf16", "output_dir": {str(tmp_path / "out")!r}}})
        est = estimate_memory(cfg, 1)
        print(json.dumps({{"est": est.as_dict(), "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                          "cuda_initialized": torch.cuda.is_initialized()}}))
    """)
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    est = result["est"]
    assert est["num_parameters"] - est["num_trainable_parameters"] == 859_520_964  # SD1.5 UNet
    assert est["latent_shape"] == [4, 64, 64] and est["weight_dtype"] == "bfloat16"
    assert est["weights"] > 1.5 * GiB
    assert result["maxrss_kib"] * 1024 < 1.5 * GiB  # fp32 weights alone would be 3.2 GiB
    assert not result["cuda_initialized"]
    assert 0 < est["activations"] < 8 * GiB
