"""Automagic: the update rule by hand, bounds and their errors, stochastic rounding, state round trip."""

from __future__ import annotations

import io

import pytest
import torch

from simpletuner.training.optimizers.automagic import Automagic, automagic_param_groups

# Bounds on which the expected lrs are plain decimals: lr0 + bump hits max, lr0 - bump hits min.
MIN_LR, LR0, MAX_LR, BUMP = 0.01, 0.02, 0.03, 0.01
BETA2 = 0.5
EPS = 1e-30


def _step(opt: Automagic, params_and_grads) -> None:
    for p, g in params_and_grads:
        p.grad = torch.as_tensor(g, dtype=p.dtype)
    opt.step()


def _assert_close(actual: torch.Tensor, expected, rtol=1e-6, atol=1e-9) -> None:
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), rtol=rtol, atol=atol)


def _clip(u: torch.Tensor, threshold: float = 1.0) -> torch.Tensor:
    return u / max(1.0, float(u.square().mean().sqrt()) / threshold)


def _hand_optimizer(params, **overrides) -> Automagic:
    options = dict(lr=LR0, min_lr=MIN_LR, max_lr=MAX_LR, lr_bump=BUMP, beta2=BETA2, eps=EPS)
    return Automagic(params, **{**options, **overrides})


def test_update_rule_1d_by_hand():
    p0 = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    p = torch.nn.Parameter(p0.float().clone())
    opt = _hand_optimizer([p])
    # element 0 keeps its sign (lr up, then clamped at max); 1 flips twice (down, clamped at
    # min); 2 keeps then flips (up, back); 3 has a zero gradient in step 2 (no change either
    # side of it). Step 4 flips 0 and 1 again and lets 2 and 3 agree.
    g1 = torch.tensor([0.5, 1.0, -2.0, 1.0], dtype=torch.float64)
    g2 = torch.tensor([0.25, -3.0, -1.0, 0.0], dtype=torch.float64)
    g3 = torch.tensor([2.0, 0.5, 0.5, 1.0], dtype=torch.float64)

    # step 1: v_hat = g1**2 (bias-corrected), u = sign(g1), RMS(u) = 1: no clipping, no previous sign.
    _step(opt, [(p, g1)])
    p1 = p0 - LR0 * torch.sign(g1)
    _assert_close(p, p1)
    _assert_close(opt.lr_of(p), [LR0] * 4)
    assert opt.state[p]["sign"].tolist() == [1, 1, -1, 1]

    # step 2
    _step(opt, [(p, g2)])
    v1 = (1 - BETA2) * (g1**2 + EPS)
    v2 = BETA2 * v1 + (1 - BETA2) * (g2**2 + EPS)
    u2 = _clip(g2 / (v2 / (1 - BETA2**2)).sqrt())
    lr2 = torch.tensor([LR0 + BUMP, LR0 - BUMP, LR0 + BUMP, LR0], dtype=torch.float64)
    p2 = p1 - lr2 * u2
    _assert_close(opt.lr_of(p), lr2)
    _assert_close(p, p2)
    _assert_close(opt.state[p]["var"], v2)
    assert opt.state[p]["sign"].tolist() == [1, -1, -1, 0]

    # step 3
    _step(opt, [(p, g3)])
    v3 = BETA2 * v2 + (1 - BETA2) * (g3**2 + EPS)
    u3 = _clip(g3 / (v3 / (1 - BETA2**3)).sqrt())
    lr3 = torch.tensor([MAX_LR, MIN_LR, LR0, LR0], dtype=torch.float64)  # 0.03 + 0.01 -> max, 0.01 - 0.01 -> min
    _assert_close(opt.lr_of(p), lr3)
    p3 = p2 - lr3 * u3
    _assert_close(p, p3)
    assert opt.state[p]["step"] == 3

    # step 4: off the bounds again (0 flips at max, 1 flips at min), 3 agrees at last.
    g4 = torch.tensor([-1.0, -1.0, 1.0, 2.0], dtype=torch.float64)
    _step(opt, [(p, g4)])
    v4 = BETA2 * v3 + (1 - BETA2) * (g4**2 + EPS)
    u4 = _clip(g4 / (v4 / (1 - BETA2**4)).sqrt())
    lr4 = torch.tensor([MAX_LR - BUMP, MIN_LR, LR0 + BUMP, LR0 + BUMP], dtype=torch.float64)
    _assert_close(opt.lr_of(p), lr4)
    _assert_close(p, p3 - lr4 * u4)


def test_update_rule_2d_factored_by_hand():
    p0 = torch.tensor([[1.0, 2.0, -1.0], [0.5, -0.5, 0.0]], dtype=torch.float64)
    p = torch.nn.Parameter(p0.float().clone())
    opt = _hand_optimizer([p])
    # A rank-1 gradient has rank-1 squares, which the row/column factors reproduce exactly.
    g1 = torch.outer(torch.tensor([1.0, 2.0]), torch.tensor([1.0, -3.0, 0.5])).double()
    _step(opt, [(p, g1)])
    p1 = p0 - LR0 * torch.sign(g1)
    _assert_close(p, p1)
    row1 = (1 - BETA2) * (g1**2 + EPS).mean(dim=1)
    col1 = (1 - BETA2) * (g1**2 + EPS).mean(dim=0)
    _assert_close(opt.state[p]["row_var"], row1)
    _assert_close(opt.state[p]["col_var"], col1)

    g2 = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.25, -0.5]], dtype=torch.float64)
    _step(opt, [(p, g2)])
    row2 = BETA2 * row1 + (1 - BETA2) * (g2**2 + EPS).mean(dim=1)
    col2 = BETA2 * col1 + (1 - BETA2) * (g2**2 + EPS).mean(dim=0)
    v_hat = torch.outer(row2 / row2.mean(), col2 / (1 - BETA2**2))
    u2 = _clip(g2 / v_hat.sqrt())
    up, down = LR0 + BUMP, LR0 - BUMP
    lr2 = torch.tensor([[up, up, up], [up, down, down]], dtype=torch.float64)
    _assert_close(opt.lr_of(p), lr2)
    _assert_close(p, p1 - lr2 * u2)


def test_conv_weight_is_factored_over_first_dim():
    w = torch.nn.Parameter(torch.zeros(4, 3, 2, 2))
    opt = _hand_optimizer([w])
    _step(opt, [(w, torch.randn(4, 3, 2, 2))])
    assert opt.state[w]["row_var"].shape == (4,)
    assert opt.state[w]["col_var"].shape == (12,)


def test_rms_clipping_limits_the_update():
    # lr pinned (min == max), so the parameter change is -lr * u.
    p = torch.nn.Parameter(torch.zeros(4))
    opt = Automagic([p], lr=0.1, min_lr=0.1, max_lr=0.1, lr_bump=0.01, beta2=BETA2, clip_threshold=0.5)
    _step(opt, [(p, [0.01, 0.01, 0.01, 0.01])])
    before = p.detach().clone()
    # The jump in gradient makes u = g / sqrt(v_hat) ~ 1.22 per element, RMS > 0.5: clipped.
    g2 = torch.tensor([1.0, 1.0, 0.01, -1.0], dtype=torch.float64)
    _step(opt, [(p, g2)])
    v2 = BETA2 * (1 - BETA2) * (1e-4 + EPS) + (1 - BETA2) * (g2**2 + EPS)
    u = g2 / (v2 / (1 - BETA2**2)).sqrt()
    assert float(u.square().mean().sqrt()) > 0.5
    u_clipped = u / (float(u.square().mean().sqrt()) / 0.5)
    _assert_close(p - before, -0.1 * u_clipped)
    _assert_close((p - before).square().mean().sqrt() / 0.1, 0.5)


def test_decoupled_weight_decay():
    p0 = torch.tensor([2.0, -4.0, 1.0], dtype=torch.float64)
    p = torch.nn.Parameter(p0.float().clone())
    opt = _hand_optimizer([p], weight_decay=0.5)
    g = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)  # a zero gradient: decay alone
    _step(opt, [(p, g)])
    _assert_close(p, p0 * (1 - LR0 * 0.5) - LR0 * torch.sign(g))


def test_lr_schedule_scales_the_step_not_the_bounds():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = _hand_optimizer([p])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.25)
    _step(opt, [(p, [1.0, -1.0])])
    scheduler.step()
    _assert_close(p, [-0.25 * LR0, 0.25 * LR0])
    _assert_close(opt.lr_of(p), [LR0, LR0])


def test_bumps_stay_exact_near_max_lr():
    # 1e-6 bumps at ~1e-3 round away in bf16; on the int16 grid 90 of them add up exactly.
    p = torch.nn.Parameter(torch.zeros(3))
    opt = Automagic([p], lr=9e-4, min_lr=1e-7, max_lr=1e-3, lr_bump=1e-6)
    for _ in range(91):  # the first step sets the sign, 90 agree
        _step(opt, [(p, [1.0, 1.0, 1.0])])
    _assert_close(opt.lr_of(p), [9.9e-4] * 3, rtol=0, atol=2e-8)
    for _ in range(20):
        _step(opt, [(p, [1.0, 1.0, 1.0])])
    _assert_close(opt.lr_of(p), [1e-3] * 3, rtol=1e-7, atol=0)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(lr=1e-4, min_lr=1e-3, max_lr=1e-4), "min_lr=0.001 is greater than max_lr=0.0001"),
        (dict(lr=1e-2, min_lr=1e-5, max_lr=1e-3), r"initial lr=0.01 is outside \[min_lr, max_lr\]"),
        (dict(lr=1e-6, min_lr=1e-5, max_lr=1e-3), "initial lr=1e-06 is outside"),
        (dict(lr=1e-4, min_lr=0.0, max_lr=1e-3), "min_lr=0.0 must be a finite number > 0"),
        (dict(lr=1e-4, min_lr=1e-5, max_lr=1e-3, lr_bump=0.0), "lr_bump=0.0 must be"),
        (dict(lr=1e-4, min_lr=1e-7, max_lr=1e-1, lr_bump=1e-9), "below the per-element lr resolution"),
        (dict(beta2=1.0), r"beta2=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_bounds_raise_before_training(options, message):
    with pytest.raises(ValueError, match=message):
        Automagic([torch.nn.Parameter(torch.zeros(2))], **options)


def test_bounds_error_names_the_group():
    good = {"params": [torch.nn.Parameter(torch.zeros(2))], "name": "low_noise"}
    bad = {"params": [torch.nn.Parameter(torch.zeros(2))], "name": "high_noise", "min_lr": 1e-3, "max_lr": 1e-4}
    message = "param group 'high_noise': min_lr=0.001 is greater than max_lr=0.0001; set min_lr <= max_lr"
    with pytest.raises(ValueError, match=message):
        Automagic([good, bad], lr=1e-4)
    with pytest.raises(ValueError, match="param group 1:"):
        Automagic([{"params": [torch.nn.Parameter(torch.zeros(2))]}, {**bad, "name": None}], lr=1e-4)


def test_per_stage_groups_take_their_own_bounds():
    high = torch.nn.Parameter(torch.zeros(2))
    low = torch.nn.Parameter(torch.zeros(2))
    bounds = {
        "lr": 0.02,
        "lr_bump": 0.01,
        "min_lr": 0.01,
        "max_lr": 0.05,
        "high_noise_max_lr": 0.03,
        "high_noise_lr_bump": None,
        "low_noise_lr_bump": 0.005,
        "low_noise_min_lr": None,
        "learning_rate": 1.0,  # unrelated config keys are ignored
    }
    groups = automagic_param_groups({"high_noise": [high], "low_noise": [low]}, bounds)
    assert [(g["name"], g["lr"], g["lr_bump"], g["min_lr"], g["max_lr"]) for g in groups] == [
        ("high_noise", 0.02, 0.01, 0.01, 0.03),
        ("low_noise", 0.02, 0.005, 0.01, 0.05),
    ]
    opt = Automagic(groups)
    for _ in range(4):
        _step(opt, [(high, [1.0, 1.0]), (low, [1.0, 1.0])])
    _assert_close(opt.lr_of(high), [0.03, 0.03])  # clamped at its own max
    _assert_close(opt.lr_of(low), [0.035, 0.035])  # 3 bumps of its own 0.005
    assert opt.mean_lr() == pytest.approx([0.03, 0.035])

    with pytest.raises(ValueError, match="'high_noise': min_lr=0.04 is greater than max_lr=0.03"):
        Automagic(automagic_param_groups({"high_noise": [high]}, {**bounds, "high_noise_min_lr": 0.04}))


def _tiny_updates(seed: int, *, stochastic_rounding: bool = True, num_steps: int = 1000) -> torch.Tensor:
    # min == max pins the lr, and a constant gradient makes u = 1: each step subtracts 1e-4,
    # a quarter of the half-ulp (2**-9) below 1.0 in bf16.
    p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = Automagic(
        [p], lr=1e-4, min_lr=1e-4, max_lr=1e-4, lr_bump=1e-6, seed=seed, stochastic_rounding=stochastic_rounding
    )
    p.grad = torch.ones_like(p)
    for _ in range(num_steps):
        opt.step()
    return p.detach().clone()


def test_stochastic_rounding_accumulates_sub_ulp_updates():
    moved = 1.0 - _tiny_updates(seed=0).double()
    assert moved.mean().item() == pytest.approx(0.1, rel=0.03)  # 1000 * 1e-4 on average
    assert torch.equal(_tiny_updates(seed=0, stochastic_rounding=False), torch.ones(64, dtype=torch.bfloat16))


def test_stochastic_rounding_is_reproducible_by_seed():
    assert torch.equal(_tiny_updates(seed=3, num_steps=50), _tiny_updates(seed=3, num_steps=50))
    assert not torch.equal(_tiny_updates(seed=3, num_steps=50), _tiny_updates(seed=4, num_steps=50))


def _model(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape).to(dtype)) for shape in [(8, 6), (6,), (3, 2, 2, 2)]]


def _train(opt: Automagic, params, grads) -> None:
    for step_grads in grads:
        _step(opt, zip(params, step_grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("through_file", [False, True])
def test_state_round_trip_is_exact(dtype, through_file):
    generator = torch.Generator().manual_seed(1)
    params = _model(dtype)
    grads = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(12)]
    options = dict(lr=1e-3, min_lr=1e-4, max_lr=1e-2, lr_bump=5e-4, weight_decay=0.01, seed=7)
    opt = Automagic(
        [{"params": params[:2], "name": "high_noise"}, {"params": params[2:], "name": "low_noise"}], **options
    )
    _train(opt, params, grads[:6])

    state_dict = opt.state_dict()
    if through_file:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        buffer.seek(0)
        state_dict = torch.load(buffer, map_location="cpu", weights_only=True)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = Automagic(
        [{"params": resumed_params[:2], "name": "high_noise"}, {"params": resumed_params[2:], "name": "low_noise"}],
        **{**options, "seed": 99},  # the saved generator state wins over the new seed
    )
    resumed.load_state_dict(state_dict)

    for p, q in zip(params, resumed_params):
        for key, value in opt.state[p].items():
            loaded = resumed.state[q][key]
            assert type(loaded) is type(value)
            if isinstance(value, torch.Tensor):
                assert loaded.dtype == value.dtype and torch.equal(loaded, value), key
                assert loaded.data_ptr() != value.data_ptr()  # not aliased with the saved state
            else:
                assert loaded == value
    _train(opt, params, grads[6:])
    _train(resumed, resumed_params, grads[6:])
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)
    assert [g["name"] for g in resumed.param_groups] == ["high_noise", "low_noise"]


def test_compact_state_dtypes():
    params = _model(torch.bfloat16)
    opt = Automagic(params, lr=1e-3, min_lr=1e-4, max_lr=1e-2, lr_bump=5e-4)
    _train(opt, params, [[torch.randn(p.shape) for p in params]])
    for p in params:
        state = opt.state[p]
        assert state["lr_index"].dtype == torch.int16 and state["lr_index"].shape == p.shape
        assert state["sign"].dtype == torch.int8 and state["sign"].shape == p.shape
        moments = [state[k] for k in ("row_var", "col_var", "var") if k in state]
        assert all(m.dtype == torch.float32 for m in moments)
        if p.dim() >= 2:
            assert sum(m.numel() for m in moments) == p.shape[0] + p.numel() // p.shape[0]


# --- wired into the trainer --------------------------------------------------------------------
def _train_cfg(raw):
    from simpletuner.configuration import validate_config
    from simpletuner.state import StateTracker
    from simpletuner.training.trainer import Trainer

    trainer = Trainer(StateTracker(validate_config(raw), raw))
    return trainer, trainer.train()


def test_config_bounds_are_checked_before_training(make_config):
    from simpletuner.configuration import ConfigError, validate_config

    with pytest.raises(ConfigError, match="min_lr 0.01 is greater than max_lr 0.001"):
        validate_config(make_config(optimizer="automagic", min_lr=1e-2, max_lr=1e-3))
    with pytest.raises(ConfigError, match="learning_rate 0.1 is outside"):
        validate_config(make_config(optimizer="automagic", learning_rate=0.1))


def test_trainer_resumes_automagic_exactly_and_the_estimate_counts_its_state(make_config, tmp_path):
    from safetensors.torch import load_file

    from simpletuner.configuration import validate_config
    from simpletuner.memory.estimator import estimate_memory

    common = dict(optimizer="automagic", learning_rate=1e-3, min_lr=1e-5, max_lr=1e-2, lr_bump=1e-4)
    straight, s_result = _train_cfg(make_config(max_train_steps=4, output_dir=str(tmp_path / "a"), **common))
    out = tmp_path / "b"
    _train_cfg(make_config(max_train_steps=2, checkpointing_steps=2, output_dir=str(out), **common))
    resumed, r_result = _train_cfg(
        make_config(max_train_steps=4, output_dir=str(out), resume_from_checkpoint="latest", **common)
    )
    assert r_result.losses == s_result.losses[2:]
    want, got = load_file(s_result.output_path), load_file(r_result.output_path)
    assert all(torch.equal(want[k], got[k]) for k in want)
    # The per-element learning rates moved away from the start and were restored exactly.
    lrs = [t for st in straight.optimizer.state.values() for k, t in st.items() if k == "lr_index"]
    assert lrs and any(int(t.max()) != int(t.min()) for t in lrs)

    state_bytes = sum(
        t.nbytes for st in straight.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)
    )
    assert estimate_memory(validate_config(make_config(**common)), device_kind="cpu").optimizer_state == state_bytes
