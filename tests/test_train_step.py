"""``Trainer.train_step`` alone, on real tiny parts: the tiny SD spec and UNet with its LoRA, a real
optimizer and schedule, and fixed micro-batches built by hand (no dataset, no cache fill).

The trainer is set up by its own builders as far as a step needs (``training_helpers.step_trainer``);
each test compares the step with the same arithmetic done by hand.
"""

from __future__ import annotations

import pytest
import torch
from fakes import NanGradient
from training_helpers import fixed_batch, step_trainer

from simpletuner.training.batches import Batch
from simpletuner.training.trainer import Trainer


def _trainer(make_config, **overrides) -> Trainer:
    return step_trainer(make_config, **{"lr_scheduler": "linear", **overrides})


def _batch(num_samples: int, seed: int, nan: bool = False) -> Batch:
    return fixed_batch(num_samples, seed, nan)


def _weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.trainable_params]


def _by_hand(trainer: Trainer, window: list[Batch]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every sample's loss in the window, drawn with the generator state the step will start from,
    and the gradient of their sum over the window's samples; the model is left as it was."""
    gen = torch.Generator()
    gen.set_state(trainer.generator.get_state())
    per_sample = torch.cat([trainer.spec.training_loss(trainer.model, b.latents, b.conditioning, gen) for b in window])
    grads = torch.autograd.grad(per_sample.sum() / per_sample.numel(), trainer.trainable_params)
    return per_sample.detach(), list(grads)


def test_a_finite_window_steps_optimizer_and_schedule_once(make_config):
    trainer = _trainer(make_config, max_grad_norm=None)
    before, lr_before = _weights(trainer), trainer.lr_scheduler.get_last_lr()[0]
    outcome = trainer.train_step([_batch(2, 0), _batch(2, 1)])
    assert not outcome.skipped and outcome.num_samples == 4 and torch.isfinite(outcome.loss)
    assert trainer.lr_scheduler.last_epoch == 1 and trainer.lr_scheduler.get_last_lr()[0] != lr_before
    assert {s["step"].item() for s in trainer.optimizer.state_dict()["state"].values()} == {1.0}  # AdamW, once
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(trainer)))
    assert all(p.grad is None for p in trainer.trainable_params)  # dropped after the step
    progress = trainer.progress
    assert (progress.global_step, progress.micro_batches_seen, progress.samples_seen) == (1, 2, 4)
    assert progress.skipped_steps == 0


def test_the_loss_is_the_window_sum_over_its_samples_and_unequal_batches_weigh_by_samples(make_config):
    # SGD without clipping or weight decay: the first step moves each weight by exactly -lr * gradient.
    trainer = _trainer(make_config, optimizer="sgd", weight_decay=0.0, max_grad_norm=None, learning_rate=0.5)
    window = [_batch(1, 2), _batch(3, 3)]
    per_sample, grads = _by_hand(trainer, window)
    expected = per_sample.sum() / 4
    mean_of_means = (per_sample[:1].mean() + per_sample[1:].mean()) / 2
    assert abs(expected - mean_of_means) > 1e-4  # the check below can tell the two apart
    before = _weights(trainer)
    lr = trainer.lr_scheduler.get_last_lr()[0]
    outcome = trainer.train_step(window)
    assert torch.allclose(outcome.loss, expected, rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 0 for g in grads)
    for old, new, grad in zip(before, _weights(trainer), grads):
        torch.testing.assert_close(new, old - lr * grad, rtol=1e-4, atol=1e-7)


def test_a_nan_window_is_skipped_and_nothing_advances(make_config, caplog):
    trainer = _trainer(make_config)
    trainer.train_step([_batch(2, 4)])  # a good step first: optimizer state to compare
    weights, optimizer_state = _weights(trainer), trainer.optimizer.state_dict()
    lr, last_epoch = trainer.lr_scheduler.get_last_lr(), trainer.lr_scheduler.last_epoch
    progress = (trainer.progress.global_step, trainer.progress.micro_batches_seen, trainer.progress.samples_seen)

    outcome = trainer.train_step([_batch(2, 5), _batch(2, 6, nan=True)])

    assert outcome.skipped and not torch.isfinite(outcome.loss) and outcome.num_samples == 4
    assert trainer.progress.skipped_steps == 1
    assert (trainer.progress.global_step, trainer.progress.micro_batches_seen, trainer.progress.samples_seen) == (
        progress
    )
    assert trainer.lr_scheduler.last_epoch == last_epoch and trainer.lr_scheduler.get_last_lr() == lr
    assert all(torch.equal(a, b) for a, b in zip(weights, _weights(trainer)))
    after = trainer.optimizer.state_dict()
    assert after["state"].keys() == optimizer_state["state"].keys()
    for key, state in optimizer_state["state"].items():
        assert all(torch.equal(value, after["state"][key][name]) for name, value in state.items())
    assert all(p.grad is None for p in trainer.trainable_params)
    assert "skipped the window after step 1" in caplog.text and "fixed/6-0.png" in caplog.text
    # The next finite window steps as usual.
    assert not trainer.train_step([_batch(2, 7)]).skipped and trainer.progress.global_step == 2


def test_run_window_takes_the_window_the_accumulation_policy_names(make_config):
    trainer = _trainer(make_config, gradient_accumulation_steps=2)
    batches = iter([_batch(1, 8), _batch(2, 9), _batch(1, 10)])
    outcome = trainer.run_window(batches)
    assert not outcome.skipped and outcome.num_samples == 3
    assert trainer.progress.micro_batches_seen == 2 and trainer.progress.samples_seen == 3
    assert next(batches).samples[0].key == "fixed/10-0.png"  # the third micro-batch is the next window's


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_a_nan_gradient_is_skipped_with_and_without_clipping(make_config, max_grad_norm):
    trainer = _trainer(make_config, max_grad_norm=max_grad_norm)
    weights = _weights(trainer)
    window = [_batch(2, 11)]
    original = trainer.spec.training_loss
    trainer.spec.training_loss = lambda *args, **kwargs: NanGradient.apply(original(*args, **kwargs))  # NaN gradient
    outcome = trainer.train_step(window)
    assert outcome.skipped and torch.isfinite(outcome.loss)
    assert trainer.lr_scheduler.last_epoch == 0 and trainer.progress.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, _weights(trainer)))
