"""Auto-config: the search, its monotonicity in memory, the ramp, and the does-not-fit advice."""

from __future__ import annotations

import dataclasses

import pytest

from simpletuner.configuration import validate_config
from simpletuner.memory.advice import DDP_BUCKETS, VALIDATION_MODELS, suggest_switches
from simpletuner.memory.autoconfig import (
    DoesNotFit,
    EstimateCache,
    divisors,
    largest_fitting,
    micro_batch_candidates,
    plan_batch,
)
from simpletuner.memory.components import validation_model_bytes
from simpletuner.memory.estimator import GiB, MemoryBreakdown

MiB = 1 << 20


def _breakdown(
    batch: int,
    checkpointing: bool,
    *,
    weights=2 * GiB,
    trainable=64 * MiB,
    optimizer_state=128 * MiB,
    per_sample=(300 * MiB, 80 * MiB),
    overhead=800 * MiB,
    **assumed,
) -> MemoryBreakdown:
    """A synthetic breakdown: activations linear in the batch, smaller with checkpointing."""
    activations = batch * per_sample[1 if checkpointing else 0]
    total = weights + trainable + optimizer_state + activations + overhead
    fields = dict(
        weights=weights,
        trainable_weights=trainable,
        gradients=trainable,
        optimizer_state=optimizer_state,
        activations=activations,
        batch_data=0,
        framework_overhead=overhead,
        total=total,
        optimizer_transient=0,
        backward_peak=activations + trainable,
        not_live_at_once=0,
        cuda_context=overhead,
        workspaces=0,
        fragmentation=0,
        model_family="sd",
        micro_batch_size=batch,
        resolution=512,
        latent_shape=(4, 64, 64),
        weight_dtype="bfloat16",
        trainable_dtype="float32",
        adapter="lora r16",
        optimizer="adamw",
        gradient_checkpointing=checkpointing,
        mixed_precision="bf16",
        device_kind="cuda",
        num_parameters=1,
        num_trainable_parameters=1,
    )
    fields.update(assumed)
    return MemoryBreakdown(**fields)


class FakeEstimates:
    """An estimate_fn that counts its calls and builds :func:`_breakdown` from the config."""

    def __init__(self, **parts):
        self.calls: list[tuple[int, bool]] = []
        self.parts = parts

    def __call__(self, config, batch_size):
        self.calls.append((batch_size, config.gradient_checkpointing))
        return _breakdown(batch_size, config.gradient_checkpointing, **self.parts)


@pytest.fixture
def config(make_config):
    return lambda **kw: validate_config(make_config(**kw))


def test_divisors_and_candidates():
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert micro_batch_candidates(32) == [1, 2, 4, 8, 16, 32]
    assert micro_batch_candidates(32, num_processes=4) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="does not split over 3 processes"):
        micro_batch_candidates(32, num_processes=3)


def test_largest_fitting_tries_the_largest_first_then_bisects():
    calls = []

    def fits(limit):
        return lambda m: calls.append(m) or m <= limit

    candidates = list(range(1, 65))
    assert largest_fitting(candidates, fits(64)) == 64 and calls == [64]
    for limit in (0, 1, 17, 63):
        calls.clear()
        assert largest_fitting(candidates, fits(limit)) == (limit or None)
        assert len(calls) <= 8  # 1 + ceil(log2(63))


def test_plan_is_monotone_in_memory(config):
    """More memory never gives a smaller micro-batch, and never turns checkpointing on at the
    same micro-batch; the split always multiplies back to the target."""
    cfg = config(train_batch_size=1)
    fake = FakeEstimates()
    cache = EstimateCache(cfg, estimate_fn=fake)
    previous = None
    for tenth_gib in range(20, 200):  # 2.0 .. 19.9 GiB
        try:
            plan = plan_batch(cfg, tenth_gib * GiB // 10, 32, estimates=cache)
        except DoesNotFit:
            assert previous is None, "a plan that fitted stopped fitting with more memory"
            continue
        assert plan.micro_batch_size * plan.gradient_accumulation_steps == 32
        assert plan.estimate.total <= plan.budget_bytes
        if previous is not None:
            assert plan.micro_batch_size >= previous.micro_batch_size
            if plan.micro_batch_size == previous.micro_batch_size:
                assert plan.gradient_checkpointing <= previous.gradient_checkpointing
        previous = plan
    assert previous.micro_batch_size == 32 and not previous.gradient_checkpointing
    assert len(fake.calls) == len(set(fake.calls)) <= 12, "each (batch, checkpointing) is estimated once"


def test_plan_on_the_tiny_model_is_monotone(config):
    """The same property with real estimates (one cache shared by every memory size)."""
    cfg = config(train_batch_size=1)
    cache = EstimateCache(cfg)
    plans = []
    for gib in (0.9, 0.9485, 0.949, 0.955, 80):
        try:
            plans.append(plan_batch(cfg, int(gib * GiB), 4, estimates=cache))
        except DoesNotFit as exc:
            assert not plans, f"fitted at less memory, not at {gib} GiB: {exc}"
    assert plans, "80 GiB must fit the tiny model"
    for smaller, larger in zip(plans, plans[1:]):
        assert larger.micro_batch_size >= smaller.micro_batch_size
        if larger.micro_batch_size == smaller.micro_batch_size:
            assert larger.gradient_checkpointing <= smaller.gradient_checkpointing
    assert plans[-1].micro_batch_size == 4 and not plans[-1].gradient_checkpointing


def test_checkpointing_only_when_it_buys_a_larger_micro_batch(config):
    cfg = config()
    cache = EstimateCache(cfg, estimate_fn=FakeEstimates())
    # 2 + 0.0625 + 0.125 + 0.78 GiB fixed; 300 MiB per sample without checkpointing, 80 MiB with.
    roomy = plan_batch(cfg, 40 * GiB, 16, estimates=cache)
    assert (roomy.micro_batch_size, roomy.gradient_checkpointing) == (16, False)
    assert roomy.without_checkpointing is None
    tight = plan_batch(cfg, 6 * GiB, 16, estimates=cache)
    assert tight.gradient_checkpointing and tight.micro_batch_size == 16
    assert tight.without_checkpointing is not None and tight.without_checkpointing.micro_batch_size == 4
    assert any("without it micro-batch 4 fits" in note for note in tight.notes)
    assert tight.config_updates() == {
        "train_batch_size": 16,
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": True,
    }


def test_does_not_fit_names_the_dominant_part_and_only_useful_switches(config):
    full = config(training_type="full", mixed_precision="no", optimizer="adamw", resolution=768)
    fake = FakeEstimates(per_sample=(6 * GiB, 3 * GiB))
    with pytest.raises(DoesNotFit) as info:
        plan_batch(full, 4 * GiB, 8, estimates=EstimateCache(full, estimate_fn=fake))
    message = str(info.value)
    assert "even micro-batch 1 with gradient checkpointing" in message
    assert "The largest part is activations: 3.00 GiB" in message
    for switch in ("training_type: lora", "mixed_precision: bf16", "optimizer: sgd", "a lower resolution (now 768"):
        assert switch in message
    assert "gradient_checkpointing: true" not in message  # it was on already in the last try
    assert info.value.breakdown.micro_batch_size == 1

    lora = config(training_type="lora", mixed_precision="bf16", optimizer="sgd")
    switches = suggest_switches(lora, _breakdown(1, True))
    assert not any(
        s.startswith(("training_type", "mixed_precision", "optimizer", "gradient_checkpointing")) for s in switches
    )


def test_overhead_alone_too_big_says_the_gpu_is_too_small(config):
    cfg = config()
    with pytest.raises(DoesNotFit, match="alone exceed the budget: this GPU is too small to train on"):
        plan_batch(cfg, 100 * MiB, 2, estimates=EstimateCache(cfg, estimate_fn=FakeEstimates()))


def test_ramp_keeps_its_target_and_limits_the_micro_batch(config):
    ramp = {
        "enable_batch_size_rampup": True,
        "initial_effective_batch_size": 8,
        "target_effective_batch_size": 64,
        "batch_rampup_steps": 10,
    }
    cfg = config(train_batch_size=2, gh200_optimizations=ramp)
    cache = EstimateCache(cfg, estimate_fn=FakeEstimates())
    plan = plan_batch(cfg, 80 * GiB, estimates=cache)
    assert plan.effective_batch_size == 64 and plan.candidates == [1, 2, 4, 8]
    assert plan.micro_batch_size == 8 and plan.ramp_windows == (1, 8)
    assert "gradient_accumulation_steps" not in plan.config_updates()
    assert any("caps the micro-batch at 8" in note for note in plan.notes)
    with pytest.raises(ValueError, match="ramps the effective batch from 8 to 64"):
        plan_batch(cfg, 80 * GiB, 32, estimates=cache)
    with pytest.raises(ValueError, match="no micro-batch splits both ends of the ramp"):
        plan_batch(
            config(train_batch_size=1, gh200_optimizations={**ramp, "initial_effective_batch_size": 2}),
            80 * GiB,
            num_processes=4,
            estimates=None,
        )


def test_extras_validation_models_and_ddp_buckets(config):
    plain = config()
    assert validation_model_bytes(plain) == 0
    with_validation = config(validation_prompt="a red square", mixed_precision="bf16")
    validation = validation_model_bytes(with_validation)
    assert validation > 0
    cache = EstimateCache(with_validation, num_processes=2, estimate_fn=FakeEstimates())
    plan = plan_batch(with_validation, 80 * GiB, 4, num_processes=2, estimates=cache)
    assert plan.estimate.extras == {VALIDATION_MODELS: validation, DDP_BUCKETS: 64 * MiB}
    assert plan.estimate.total == plan.estimate.breakdown.total + validation + 64 * MiB
    assert plan.micro_batch_size * plan.gradient_accumulation_steps * 2 == 4
    assert any("validation_prompt is set" in note for note in plan.notes)
    # low_vram: they visit the GPU only while sampling, in place of the training activations.
    from simpletuner.memory.autoconfig import extra_bytes

    low = config(validation_prompt="a red square", mixed_precision="bf16", low_vram=True)
    breakdown = plan.estimate.breakdown
    assert extra_bytes(low, breakdown, validation_bytes=validation).get(VALIDATION_MODELS, 0) == max(
        0, validation - breakdown.activations
    )
    assert extra_bytes(low, breakdown, validation_bytes=breakdown.activations + 5) == {VALIDATION_MODELS: 5}


def test_bad_margins_and_memory(config):
    cfg = config()
    with pytest.raises(ValueError, match="safety-margin"):
        plan_batch(cfg, GiB, 2, safety_margin=1.5, estimates=EstimateCache(cfg, estimate_fn=FakeEstimates()))
    with pytest.raises(ValueError, match="usable memory must be positive"):
        plan_batch(cfg, 0, 2)


def test_plan_as_dict_is_json(config):
    import json

    cfg = config()
    plan = plan_batch(cfg, 8 * GiB, 8, estimates=EstimateCache(cfg, estimate_fn=FakeEstimates()))
    data = json.loads(json.dumps(plan.as_dict()))
    assert data["config_updates"]["train_batch_size"] == plan.micro_batch_size
    assert [t["micro_batch_size"] for t in data["tried"]] == [e.micro_batch_size for e in plan.tried]
    assert dataclasses.asdict(plan.estimate.breakdown)["total"] == data["estimate"]["total"]
