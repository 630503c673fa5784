"""SimpleTuner's optimizers here: `adamw_bf16` (AdamW with stochastic rounding into bf16), `prodigy`
(prodigyopt, one d per group, `prodigy_steps`, `optimizer_config`), and `vae_batch_size`."""

from __future__ import annotations

import io
import math
import sys
from collections import Counter

import pytest
import torch

from simpletuner.configuration import ConfigError, validate_config
from simpletuner.configuration.optimizer_settings import parse_optimizer_config
from simpletuner.training.optimizers.adamw_bf16 import AdamWBF16
from simpletuner.training.optimizers.prodigy import prodigy_class

prodigyopt = pytest.importorskip("prodigyopt", reason="the prodigy extra is not installed")


def _params(dtype, seed=0, shapes=((16, 8), (8,), (4, 3, 3, 3))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params, seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _run(opt, params, steps, start=0):
    for step in range(start, start + steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g.clone()
        opt.step()


def _clones(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


# --- adamw_bf16 --------------------------------------------------------------------------------------
def test_adamw_bf16_is_torch_adamw_bit_for_bit_on_fp32_weights():
    ours_params, torch_params = _params(torch.float32), _params(torch.float32)
    settings = dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    # Two groups with their own learning rates (as the Wan 2.2 experts have).
    ours = AdamWBF16([{"params": ours_params[:2], "lr": 3e-2}, {"params": ours_params[2:], "lr": 1e-3}], **settings)
    ref = torch.optim.AdamW(
        [{"params": torch_params[:2], "lr": 3e-2}, {"params": torch_params[2:], "lr": 1e-3}], **settings
    )
    for step in range(6):
        _run(ours, ours_params, 1, start=step)
        _run(ref, torch_params, 1, start=step)
        for p, q in zip(ours_params, torch_params):
            assert torch.equal(p, q), step
            assert torch.equal(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
    assert not torch.equal(ours_params[0], _params(torch.float32)[0])  # it did move


def _bf16_neighbours(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each float64 value."""
    down = values.to(torch.bfloat16)  # nearest; step to the other side where it rounded past
    down = torch.where(down.double() > values, torch.nextafter(down, torch.tensor(-math.inf, dtype=down.dtype)), down)
    up = torch.where(down.double() < values, torch.nextafter(down, torch.tensor(math.inf, dtype=down.dtype)), down)
    return down.double(), up.double()


def test_adamw_bf16_rounds_a_sub_ulp_update_without_bias():
    # 65,536 weights of 1.0 and a gradient of +1: the first Adam step is lr * g / (|g| + eps) by hand,
    # 1e-3, a quarter of the bf16 spacing below 1.0 (2**-8). Rounding to nearest would store 1.0 for all.
    n, lr, eps = 1 << 16, 1e-3, 1e-8
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = AdamWBF16([p], lr=lr, eps=eps, weight_decay=0.0, seed=7)
    p.grad = torch.ones(n, dtype=torch.bfloat16)
    opt.step()
    exact = 1.0 - lr * 1.0 / (1.0 + eps)
    stored = p.detach().double()
    assert set(stored.unique().tolist()) == {1.0 - 2**-8, 1.0}  # each rounded to a neighbour of the exact value
    # Each element: 1 - 2**-8 with probability q = (1 - exact) / 2**-8, else 1.0: the mean's std by hand.
    q = (1.0 - exact) / 2**-8
    sigma = 2**-8 * math.sqrt(q * (1 - q) / n)
    assert abs(stored.mean().item() - exact) < 5 * sigma
    assert 1.0 - exact > 100 * sigma  # round-to-nearest's answer (1.0) is far outside the tolerance


def test_adamw_bf16_expected_value_is_the_fp32_update_with_weight_decay():
    n, lr, wd, eps = 1 << 15, 2e-3, 0.1, 1e-8
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen).to(torch.bfloat16)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    p = torch.nn.Parameter(p0.clone())
    opt = AdamWBF16([p], lr=lr, eps=eps, weight_decay=wd, seed=11)
    p.grad = g.clone()
    opt.step()
    # By hand (first step: m_hat = g, v_hat = g**2), in float64.
    g64 = g.double()
    exact = p0.double() * (1 - lr * wd) - lr * g64 / (g64.abs() + eps)
    down, up = _bf16_neighbours(exact)
    stored = p.detach().double()
    assert bool(((stored == down) | (stored == up)).all())
    # Unbiased: the mean rounding error is within 5 sigma of 0, sigma from each element's two neighbours.
    q = torch.where(up > down, (exact - down) / (up - down), torch.zeros_like(exact))
    sigma = math.sqrt(float(((up - down) ** 2 * q * (1 - q)).sum())) / n
    assert abs(float((stored - exact).mean())) < 5 * sigma


def test_adamw_bf16_small_steps_add_up_over_many_steps():
    # 200 steps of 1e-4 on weights of 1.0 (each step below half a bf16 spacing): the weights move by
    # about 200 * 1e-4 (Adam with a constant gradient steps lr each step), where rounding to nearest
    # would never move them.
    n, lr, steps = 1 << 14, 1e-4, 200
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = AdamWBF16([p], lr=lr, weight_decay=0.0, seed=1)
    for _ in range(steps):
        p.grad = torch.full((n,), 0.5, dtype=torch.bfloat16)
        opt.step()
    moved = 1.0 - p.detach().double().mean().item()
    # Per element at most 2**-7 / 2 rounding error a step, independent: the mean's bound by hand.
    sigma = (2**-7 / 2) * math.sqrt(steps / n)
    assert abs(moved - steps * lr) < 0.03 * steps * lr + 5 * sigma, moved
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adamw_bf16_state_resumes_exactly_through_a_file(dtype):
    params = _params(dtype)
    opt = AdamWBF16(params, lr=1e-2, seed=5)
    _run(opt, params, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed_params = _clones(params)
    resumed = AdamWBF16(resumed_params, lr=1e-2, seed=99)  # the seed comes back from the file
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    _run(opt, params, 3, start=3)
    _run(resumed, resumed_params, 3, start=3)
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)
        assert resumed.state[q]["exp_avg"].dtype == dtype


@pytest.mark.parametrize(
    "optimizer, rates, extra",
    [("adamw_bf16", (1e-3, 2e-3, 5e-4), {}), ("prodigy", (1.0, 0.8, 0.5), {"optimizer_config": "d_coef=0.5"})],
)
def test_the_config_builds_them_with_a_learning_rate_per_expert(make_config, optimizer, rates, extra):
    from simpletuner.training.optim import build_optimizer

    lr, high, low = rates
    raw = make_config(
        optimizer=optimizer,
        learning_rate=lr,
        high_noise_learning_rate=high,
        low_noise_learning_rate=low,
        weight_decay=0.02,
        adam_beta1=0.85,
        **extra,
    )
    params = _params(torch.float32)
    opt = build_optimizer(validate_config(raw), {"high_noise": params[:2], "low_noise": params[2:]})
    assert [g["lr"] for g in opt.param_groups] == [high, low]
    assert all(g["weight_decay"] == 0.02 and g["betas"] == (0.85, 0.999) for g in opt.param_groups)
    if optimizer == "prodigy":
        assert all(g["d_coef"] == 0.5 for g in opt.param_groups)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_estimate_counts_adamw_bf16_state(make_config, dtype):
    from simpletuner.memory.estimator import optimizer_bytes

    params = _params(dtype)
    opt = AdamWBF16(params)
    _run(opt, params, 1)
    real = sum(t.nbytes for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    config = validate_config(make_config(optimizer="adamw_bf16"))
    assert optimizer_bytes(config, params)[0] == real == 2 * sum(p.numel() for p in params) * dtype.itemsize


# --- prodigy -----------------------------------------------------------------------------------------
def _quadratic_grads(params, targets):
    for p, t in zip(params, targets):
        p.grad = (p.detach() - t).clone()


def test_prodigy_on_one_group_is_prodigyopt_bit_for_bit():
    ours_params, ref_params = _params(torch.float32), _params(torch.float32)
    targets = _params(torch.float32, seed=9)
    ours = prodigy_class()(ours_params, lr=1.0, weight_decay=0.01, d_coef=0.8)
    ref = prodigyopt.Prodigy(ref_params, lr=1.0, weight_decay=0.01, d_coef=0.8)
    for _ in range(5):
        _quadratic_grads(ours_params, targets)
        _quadratic_grads(ref_params, targets)
        ours.step()
        ref.step()
    assert all(torch.equal(p, q) for p, q in zip(ours_params, ref_params))
    assert ours.param_groups[0]["d"] == ref.param_groups[0]["d"] > 1e-6


def test_prodigy_estimates_d_per_group_as_separate_optimizers_would():
    # Two groups with their own lr multipliers (Wan 2.2's experts): the same as one prodigyopt
    # optimizer per group, which prodigyopt itself refuses to do in one optimizer.
    params, alone = _params(torch.float32), _params(torch.float32)
    targets = _params(torch.float32, seed=4)
    split = prodigy_class()([{"params": params[:2], "lr": 1.0}, {"params": params[2:], "lr": 0.5}])
    singles = [prodigyopt.Prodigy(alone[:2], lr=1.0), prodigyopt.Prodigy(alone[2:], lr=0.5)]
    for _ in range(5):
        _quadratic_grads(params, targets)
        _quadratic_grads(alone, targets)
        split.step()
        for opt in singles:
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, alone))
    assert [g["d"] for g in split.param_groups] == [o.param_groups[0]["d"] for o in singles]
    assert split.param_groups[0]["d"] != split.param_groups[1]["d"]
    plain_params = _params(torch.float32)
    plain = prodigyopt.Prodigy([{"params": plain_params[:2], "lr": 1.0}, {"params": plain_params[2:], "lr": 0.5}])
    _quadratic_grads(plain_params, targets)
    with pytest.raises(RuntimeError, match="different lr"):
        plain.step()


def test_prodigy_leaves_a_group_without_gradients_untouched():
    params = _params(torch.float32)
    opt = prodigy_class()([{"params": params[:1], "lr": 1.0}, {"params": params[1:], "lr": 1.0}])
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones_like(params[0])  # only the first group (expert) had a step
    opt.step()
    assert not torch.equal(params[0], before[0])
    assert all(torch.equal(p, b) for p, b in zip(params[1:], before[1:]))
    assert opt.param_groups[1]["k"] == 0 and opt.param_groups[1]["d"] == 1e-6


def test_prodigy_steps_freezes_d_after_that_many_steps():
    params, free_params = _params(torch.float32), _params(torch.float32)
    targets = _params(torch.float32, seed=2)
    frozen = prodigy_class()(params, lr=1.0, prodigy_steps=3)
    free = prodigy_class()(free_params, lr=1.0)
    ds = []
    for step in range(7):
        _quadratic_grads(params, targets)
        _quadratic_grads(free_params, targets)
        before = [p.detach().clone() for p in params]
        frozen.step()
        free.step()
        ds.append(frozen.param_groups[0]["d"])
        assert any(not torch.equal(p, b) for p, b in zip(params, before))  # the steps go on
        if step < 3:  # adapting: the same as without prodigy_steps
            assert all(torch.equal(p, q) for p, q in zip(params, free_params))
    assert ds[0] < ds[2] and ds[2:] == [ds[2]] * 5  # grew, then fixed after 3 steps
    assert free.param_groups[0]["d"] != ds[-1]
    assert frozen.param_groups[0]["d_coef"] == 1.0 and frozen.param_groups[0]["growth_rate"] == math.inf


def test_prodigy_split_groups_false_needs_one_learning_rate():
    params = _params(torch.float32)
    with pytest.raises(ValueError, match="split_groups true"):
        prodigy_class()([{"params": params[:1], "lr": 1.0}, {"params": params[1:], "lr": 0.5}], split_groups=False)


def test_missing_prodigyopt_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prodigyopt", None)
    prodigy_class.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"\.\[prodigy\]"):
            prodigy_class()
    finally:
        prodigy_class.cache_clear()


def test_prodigy_trains_a_tiny_lora_and_resumes_exactly(make_config, tmp_path):
    from safetensors.torch import load_file
    from training_helpers import same_weights, train

    from simpletuner.memory.estimator import optimizer_bytes

    common = dict(optimizer="prodigy", learning_rate=1.0, optimizer_config="d_coef=2,slice_p=2", prodigy_steps=3)
    straight, s_result = train(make_config(max_train_steps=4, output_dir=str(tmp_path / "a"), **common))
    out = tmp_path / "b"
    train(make_config(max_train_steps=2, checkpointing_steps=2, output_dir=str(out), **common))
    resumed, r_result = train(
        make_config(max_train_steps=4, output_dir=str(out), resume_from_checkpoint="latest", **common)
    )
    assert r_result.losses == s_result.losses[2:]
    weights = load_file(s_result.output_path)
    assert same_weights(weights, load_file(r_result.output_path))
    ups = [t for k, t in weights.items() if "lora_B" in k or ".up." in k]
    assert ups and all(t.abs().sum() > 0 for t in ups)  # the zero-initialised up-projections trained
    group = straight.optimizer.param_groups[0]
    assert group["d"] > 1e-6 and group["d_coef"] == 2 and group["slice_p"] == 2
    assert [g["d"] for g in resumed.optimizer.param_groups] == [g["d"] for g in straight.optimizer.param_groups]

    # The estimate counts the state; it is an upper bound by the p0 of all-zero (LoRA B) parameters.
    config = validate_config(make_config(**common))
    trainable = [p for g in straight.optimizer.param_groups for p in g["params"]]
    real = sum(t.nbytes for st in straight.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    zero_p0 = [p for p in trainable if straight.optimizer.state[p]["p0"].dim() == 0]
    assert zero_p0  # the LoRA up-projections start at zero
    slack = sum((-(-p.numel() // 2) - 1) * p.element_size() for p in zero_p0)
    assert optimizer_bytes(config, trainable)[0] == real + slack
    assert real + slack == sum(2 * p.nbytes + 2 * -(-p.numel() // 2) * p.element_size() for p in trainable)


# --- config ------------------------------------------------------------------------------------------
def test_optimizer_config_string_is_read_as_simpletuner_writes_it():
    assert parse_optimizer_config("d_coef=0.5, use_bias_correction=true,slice_p=11,beta3=none,growth_rate=1.02") == {
        "d_coef": 0.5,
        "use_bias_correction": True,
        "slice_p": 11,
        "beta3": None,
        "growth_rate": 1.02,
    }
    assert parse_optimizer_config("") == {} and parse_optimizer_config(None) == {}
    with pytest.raises(ValueError, match="key=value"):
        parse_optimizer_config("d_coef")


def _problems(raw) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    return str(info.value)


def test_prodigy_settings_are_checked_before_anything_loads(make_config):
    config = validate_config(
        make_config(optimizer="prodigy", learning_rate=1.0, optimizer_config={"d_coef": 0.5, "safeguard_warmup": True})
    )
    assert config.optimizer_config == {"d_coef": 0.5, "safeguard_warmup": True}
    text = _problems(
        make_config(
            optimizer="prodigy",
            learning_rate=1.0,
            optimizer_config="d_coef=-1,use_stableadamw=true,eps=1e-6,fancy=1,slice_p=0.5",
        )
    )
    assert "optimizer_config.d_coef is -1; it must be a number > 0" in text
    assert "use_stableadamw is a setting of SimpleTuner's Prodigy" in text
    assert "optimizer_config.eps: set it with `adam_epsilon`" in text
    assert "optimizer_config.fancy is not a setting of optimizer 'prodigy'" in text
    assert "slice_p is 0.5; it must be a whole number >= 1" in text
    assert "takes no optimizer_config settings" in _problems(make_config(optimizer_config="d_coef=1"))


def test_sgd_momentum_must_be_a_number(make_config):
    """torch.optim.SGD takes no null momentum (a TypeError at the first step): refused with the config."""
    assert validate_config(make_config(optimizer="sgd", optimizer_config={"momentum": 0.5})).optimizer_config == {
        "momentum": 0.5
    }
    for bad in (None, 1.0, -0.1):
        text = _problems(make_config(optimizer="sgd", optimizer_config={"momentum": bad}))
        assert f"optimizer_config.momentum is {bad if bad is not None else 'None'}" in text
        assert "it must be a number in [0, 1)" in text


def test_prodigy_wants_a_learning_rate_near_one(make_config):
    text = _problems(make_config(optimizer="prodigy", learning_rate=1e-4))
    assert "learning_rate 0.0001 with optimizer prodigy" in text and "Set learning_rate to 1.0" in text
    validate_config(make_config(optimizer="prodigy", learning_rate=0.5))


# --- vae_batch_size ----------------------------------------------------------------------------------
@pytest.fixture
def vae_calls(monkeypatch):
    """Batch sizes the real tiny VAE's ``encode`` is called with."""
    from simpletuner.models.sd import StableDiffusionSpec

    calls: list[int] = []
    real_load = StableDiffusionSpec.load_vae

    def load_recording(self, device, dtype):
        vae = real_load(self, device, dtype)
        real_encode = vae.encode

        def encode(pixels, *args, **kwargs):
            calls.append(pixels.shape[0])
            return real_encode(pixels, *args, **kwargs)

        vae.encode = encode
        return vae

    monkeypatch.setattr(StableDiffusionSpec, "load_vae", load_recording)
    return calls


def _expected_chunks(datasets, size):
    counts = Counter((ds.id, s.bucket) for ds in datasets for s in ds.samples)
    return sorted(c for n in counts.values() for c in [size] * (n // size) + ([n % size] if n % size else []))


@pytest.mark.parametrize("size", [3, 8])
def test_vae_batch_size_sets_images_per_vae_call(make_config, vae_calls, size):
    from training_helpers import cached_data

    _, datasets, _, _ = cached_data(make_config, vae_batch_size=size)
    assert sum(vae_calls) == 12 and max(vae_calls) <= size
    assert sorted(vae_calls) == _expected_chunks(datasets, size)
    assert validate_config(make_config()).vae_batch_size == 8  # today's batch when unset


def test_vae_batch_size_sets_the_refresh_batches_too(make_config, vae_calls):
    from training_helpers import cached_data

    from simpletuner.data_backend import BucketSampler

    data, datasets, config, _ = cached_data(
        make_config,
        vae_batch_size=3,
        augmentations={"flip_probability": 0.5},
        augmentations_cache_mode="refresh_each_epoch",
    )
    assert vae_calls == []  # nothing encoded before the epoch starts
    sampler = BucketSampler([s for ds in datasets for s in ds.samples], config.train_batch_size, 1, 0, config.seed)
    next(data.iterate(sampler, torch.device("cpu")))
    assert sorted(vae_calls) == _expected_chunks(datasets, 3)


def test_vae_batch_size_must_be_positive(make_config):
    assert "vae_batch_size" in _problems(make_config(vae_batch_size=0))


def test_prodigy_trains_wan22_experts_with_their_own_rates_and_d(make_config, tmp_path_factory):
    from training_helpers import train

    from simpletuner.testing.zoo import write_tiny_model

    model = write_tiny_model("wan22", tmp_path_factory.mktemp("tiny_wan22") / "model")
    raw = make_config(
        pretrained_model_name_or_path=str(model),
        model_family="wan",
        optimizer="prodigy",
        learning_rate=1.0,
        high_noise_learning_rate=0.5,
        max_train_steps=4,
        train_batch_size=4,
    )
    trainer, _ = train(raw)
    groups = {g["name"]: g for g in trainer.optimizer.param_groups}
    assert groups["high_noise"]["lr"] == 0.5 and groups["low_noise"]["lr"] == 1.0
    # Each expert counts only the steps routed to it (a step may reach both), and its d moves from its
    # own second step on (at its first, p equals Prodigy's starting point p0, so the estimate is 0).
    steps = [g["k"] for g in groups.values()]
    assert all(1 <= k <= 4 for k in steps) and sum(steps) >= 4, steps
    for g in groups.values():
        assert (g["d"] > 1e-6) if g["k"] >= 2 else (g["d"] == 1e-6), (g["name"], g["k"], g["d"])


def test_adamw_bf16_continues_from_a_torch_adamw_state():
    params, ref_params = _params(torch.float32), _params(torch.float32)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    _run(ref, ref_params, 2)
    for p, q in zip(params, ref_params):
        p.data.copy_(q.detach())
    buffer = io.BytesIO()
    torch.save(ref.state_dict(), buffer)  # as a checkpoint holds it
    buffer.seek(0)
    ours = AdamWBF16(params, lr=1e-2)
    ours.load_state_dict(torch.load(buffer, weights_only=True))
    _run(ref, ref_params, 2, start=2)
    _run(ours, params, 2, start=2)
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
