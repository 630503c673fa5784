"""Our Automagic against ai-toolkit's (toolkit/optimizers/automagic.py at AIT_COMMIT), on figures from its code.

The figures below are what ai-toolkit's Automagic computes for fixed gradients: a 2x3 (factored) and a 3-element
(unfactored) parameter, both starting at zero, lr 1e-5 and its defaults (min_lr 1e-7, max_lr 1e-3, lr_bump 1e-6,
beta2 0.999, eps 1e-30, clip_threshold 1.0: automagic.py:12-19), three steps. They were obtained by running its
optimizer from a scratch copy outside this repository (none of its code is here). The same rule, by its lines:

- second moments without bias correction: v = beta2 * v + (1 - beta2) * (g**2 + eps) (automagic.py:218-236),
  factored over the last two dimensions (automagic.py:219-231, _approx_sq_grad 120-124); u = g / sqrt(v);
- u /= max(1, RMS(u) / clip_threshold) (automagic.py:238-239);
- polarity u > 0, compared with the previous one, which starts all False (automagic.py:246-250, 300-302): +lr_bump
  where they agree, -lr_bump where not, clamped to [min_lr, max_lr] (automagic.py:255-266);
- p -= p * weight_decay * lr, then p -= lr * u with that new lr (automagic.py:269, 274-281);
- the lr mask is stored as int8 scaled by its largest value (automagic.py:271, optimizer_utils.py:168-181).

Where ours differs, the test asserts that the difference is the one OPTIMIZER_DIFFERENCES["automagic"] states.
"""

from __future__ import annotations

import torch

from simpletuner.configuration.aitoolkit.facts import OPTIMIZER_DIFFERENCES
from simpletuner.training.optimizers.automagic import Automagic

LR, LR_BUMP, MIN_LR, MAX_LR = 1e-5, 1e-6, 1e-7, 1e-3
#: Ours puts the lr on a grid of spacing lr_bump / 65 for these bounds: the start is off by less than one spacing.
SPACING = LR_BUMP / 65

W_GRADS = [
    [[0.1, -0.2, 0.3], [-0.4, 0.5, -0.6]],
    [[0.2, 0.1, -0.3], [-0.1, 0.4, 0.2]],
    [[0.05, -0.3, -0.2], [0.3, 0.2, -0.1]],
]
B_GRADS = [[0.3, -0.1, 0.2], [0.1, 0.1, -0.4], [-0.2, 0.3, -0.1]]

#: ai-toolkit's 2x3 parameter after steps 1, 2, 3 (from zero).
AIT_W = [
    [[-5.732130376e-06, 1.072807390e-05, -1.056952624e-05], [1.194936885e-05, -9.356861483e-06, 1.101677299e-05]],
    [[-2.065232547e-05, 5.573364888e-06, 4.595522114e-07], [1.673139559e-05, -2.038834828e-05, 6.108160051e-06]],
    [[-2.466898150e-05, 1.992851321e-05, 9.738723747e-06], [2.122551450e-06, -2.748657607e-05, 8.919688298e-06]],
]
#: Its stored per-element lr (the int8 mask, dequantised) after each step.
AIT_W_LR = [
    [[9.007873814e-06, 1.100000009e-05, 9.007873814e-06], [1.100000009e-05, 9.007873814e-06, 1.100000009e-05]],
    [[1.001574856e-05, 1.001574856e-05, 8.031496691e-06], [1.200000042e-05, 1.001574856e-05, 1.001574856e-05]],
    [[1.101574890e-05, 9.020771358e-06, 9.020771358e-06], [1.101574890e-05, 1.101574890e-05, 9.020771358e-06]],
]
AIT_B = [
    [-8.999999409e-06, 1.100000009e-05, -8.999999409e-06],
    [-1.363400315e-05, 6.482778190e-07, 1.483943379e-06],
    [-5.859308658e-06, -1.542068640e-05, 4.668160727e-06],
]
AIT_B_LR = [
    [9.007873814e-06, 1.100000009e-05, 9.007873814e-06],
    [1.000787415e-05, 1.000787415e-05, 8.037820407e-06],
    [9.014322131e-06, 1.100787449e-05, 9.014322131e-06],
]
#: Weight decay alone: p = [1, -2, 0.5], a zero gradient, weight_decay 10, one step. ai-toolkit's zero update is
#: "not positive", as its starting polarity, so the lr rises to 1.1e-5 and p *= 1 - 10 * 1.1e-5.
AIT_DECAY_P = [9.998900294e-01, -1.999780059e00, 4.999450147e-01]
AIT_DECAY_LR = 1.100000009e-05


def _int8_mask(lr: torch.Tensor) -> torch.Tensor:
    """ai-toolkit's Auto8bitTensor round trip (optimizer_utils.py:173-181)."""
    scale = lr.abs().max().item() / 127.0
    return (lr / scale).round().clamp(-127, 127).to(torch.int8).to(torch.float32) * scale


def _their_step_lrs(params: list, lrs: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """From ai-toolkit's figures: the lr each step applied (before int8 storage) and the step's normalised update."""
    applied, updates = [], []
    before = torch.zeros_like(torch.tensor(params[0], dtype=torch.float64))
    stored = torch.full_like(before, LR)
    polarity = torch.zeros_like(before, dtype=torch.bool)  # automagic.py:300-302
    for after, mask in zip(params, lrs):
        after = torch.tensor(after, dtype=torch.float64)
        step = after - before
        now = step < 0  # u > 0 moves p down (weight decay 0)
        lr = (stored + torch.where(now == polarity, LR_BUMP, -LR_BUMP)).clamp(MIN_LR, MAX_LR)
        assert torch.allclose(_int8_mask(lr.float()).double(), torch.tensor(mask, dtype=torch.float64), rtol=1e-6)
        applied.append(lr)
        updates.append(-step / lr)
        before, stored, polarity = after, torch.tensor(mask, dtype=torch.float64), now
    return applied, updates


def _ours() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    w = torch.nn.Parameter(torch.zeros(2, 3))
    b = torch.nn.Parameter(torch.zeros(3))
    opt = Automagic([w, b], lr=LR, min_lr=MIN_LR, max_lr=MAX_LR, lr_bump=LR_BUMP)
    ws, w_lrs, bs, b_lrs = [], [], [], []
    for w_grad, b_grad in zip(W_GRADS, B_GRADS):
        w.grad, b.grad = torch.tensor(w_grad), torch.tensor(b_grad)
        opt.step()
        ws.append(w.detach().clone())
        bs.append(b.detach().clone())
        w_lrs.append(opt.lr_of(w).double())
        b_lrs.append(opt.lr_of(b).double())
    return ws, w_lrs, bs, b_lrs


def _rms(t: torch.Tensor) -> float:
    return float(t.square().mean().sqrt())


def test_ai_toolkits_figures_follow_the_rule_we_describe():
    # The lr each step applied, rebuilt from its figures by the rule above, stores as its int8 mask; its
    # normalised update has RMS exactly 1 on these first steps (no bias correction: v is (1 - beta2**t) of
    # the bias-corrected value, so RMS(u) >> 1 and the clip always fires).
    for params, lrs in ((AIT_W, AIT_W_LR), (AIT_B, AIT_B_LR)):
        _, updates = _their_step_lrs(params, lrs)
        for update in updates:
            assert abs(_rms(update) - 1.0) < 1e-5


def test_ours_matches_ai_toolkits_update_direction_and_bumps_and_differs_where_documented():
    ws, w_lrs, bs, b_lrs = _ours()
    for ours, our_lrs, theirs, their_lrs in ((ws, w_lrs, AIT_W, AIT_W_LR), (bs, b_lrs, AIT_B, AIT_B_LR)):
        applied, their_updates = _their_step_lrs(theirs, their_lrs)
        before = torch.zeros_like(ours[0], dtype=torch.float64)
        our_previous_lr = None
        for k, (after, lr, their_update, their_lr) in enumerate(zip(ours, our_lrs, their_updates, applied)):
            update = -(after.double() - before) / lr
            # the same normalised update (factored second moments, the RMS clip): ours is the bias-corrected
            # step, clipped only above RMS 1, so it is theirs times min(1, its RMS)
            assert _rms(update) <= 1.0 + 1e-6
            assert torch.allclose(update / _rms(update), their_update, rtol=1e-4, atol=1e-6), k
            if k == 0:
                # step 1: ours keeps the start lr (no previous sign); theirs moves by one bump either way
                assert torch.allclose(lr, torch.full_like(lr, LR), rtol=0, atol=SPACING)
                assert torch.allclose((their_lr - LR).abs(), torch.full_like(lr, LR_BUMP), rtol=1e-9)
            else:
                # later steps: the same +bump / -bump per element, from a start that differs by step 1's bump
                # and by ai-toolkit's int8 rounding of the stored lr
                ours_moved = lr - our_previous_lr
                theirs_moved = their_lr - torch.tensor(their_lrs[k - 1], dtype=torch.float64)
                assert torch.equal(torch.sign(ours_moved), torch.sign(theirs_moved)), k
                assert torch.allclose(ours_moved.abs(), torch.full_like(lr, LR_BUMP), rtol=1e-5)
            before, our_previous_lr = after.double(), lr


def test_weight_decay_is_the_same_decoupled_term_and_a_zero_update_differs_as_documented():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = Automagic([p], lr=LR, min_lr=MIN_LR, max_lr=MAX_LR, lr_bump=LR_BUMP, weight_decay=10.0)
    p.grad = torch.zeros(3)
    opt.step()
    # both: p -= weight_decay * lr * p with the step's lr; ai-toolkit's lr rose by a bump (a zero update is "not
    # positive", as its starting polarity), ours stayed (a zero update neither raises nor lowers it)
    theirs = torch.tensor([1.0, -2.0, 0.5]) * (1 - 10.0 * AIT_DECAY_LR)
    assert torch.allclose(theirs, torch.tensor(AIT_DECAY_P), rtol=0, atol=1e-6)
    ours_lr = opt.lr_of(p)
    assert torch.allclose(ours_lr, torch.full_like(ours_lr, LR), rtol=0, atol=SPACING)
    expected = torch.tensor([1.0, -2.0, 0.5]) * (1 - 10.0 * ours_lr)
    assert torch.allclose(p.detach(), expected, rtol=0, atol=1e-6)


def test_the_translation_warning_names_each_difference():
    said = OPTIMIZER_DIFFERENCES["automagic"]
    for difference in (
        "first step",  # step 1: ai-toolkit bumps every element, ours keeps the start lr
        "int8",  # the stored lr mask
        "bias correction",  # the RMS clip fires on every early step there
        "zero update",
        "learning-rate schedule",  # ai-toolkit's Automagic never reads the group lr
        "min_lr",  # a start below min_lr is refused here
    ):
        assert difference in said, difference
