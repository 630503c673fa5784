"""``use_ema``: the average of the trained weights, on the tiny SD model.

The decay schedule is written out here from SimpleTuner's rule (``(1 + s) / (10 + s)`` with
``s = step - 1``, capped at ``ema_decay``; 0 at step 1) and the average is recomputed by hand from
the parameter values recorded after each step. Resume, the final files and their reload in
diffusers go through the real Trainer.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import fixed_batch, step_trainer, train

from simpletuner.training import checkpoint as ckpt
from simpletuner.training.batches import Batch
from simpletuner.training.ema import decay_at
from simpletuner.training.trainer import Trainer


def _hand_decay(step: int, cap: float) -> float:
    """SimpleTuner's EMA decay at optimizer step ``step``, written out independently."""
    if step == 1:
        return 0.0
    s = step - 1
    return min((1 + s) / (10 + s), cap)


def _trainer(make_config, **overrides) -> Trainer:
    """A Trainer holding what ``train_step`` uses, its EMA made by setup's own builder."""
    trainer = step_trainer(make_config, use_ema=True, **overrides)
    assert trainer.ema is not None
    return trainer


def _batch(seed: int, nan: bool = False) -> Batch:
    return fixed_batch(2, seed, nan)


def _weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.trainable_params]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=1e-6, atol=1e-9) for x, y in zip(a, b))


def test_ema_equals_the_hand_computed_average_over_three_steps(make_config):
    cap = 0.2  # step 2 uses the ramp (2/11), step 3 the cap (3/12 > 0.2)
    trainer = _trainer(make_config, ema_decay=cap, max_grad_norm=None)
    expected = _weights(trainer)
    assert _close(trainer.ema.shadow, expected)  # starts as a copy of the trained weights
    for step in (1, 2, 3):
        outcome = trainer.train_step([_batch(step)])
        assert not outcome.skipped
        decay = _hand_decay(step, cap)
        expected = [decay * e + (1 - decay) * w for e, w in zip(expected, _weights(trainer))]
        assert _close(trainer.ema.shadow, expected), step
        assert trainer.ema.last_decay == pytest.approx(decay)
    assert not _close(trainer.ema.shadow, _weights(trainer))  # an average, not the last weights
    # it covers exactly the LoRA weights
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.ema.names == [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainer.ema.names and all("lora" in n for n in trainer.ema.names)


def test_ema_is_not_updated_by_a_skipped_window(make_config):
    trainer = _trainer(make_config, ema_decay=0.9)
    trainer.train_step([_batch(1)])
    after_first = [s.clone() for s in trainer.ema.shadow]
    outcome = trainer.train_step([_batch(2, nan=True)])
    assert outcome.skipped and trainer.progress.global_step == 1
    assert all(torch.equal(a, b) for a, b in zip(after_first, trainer.ema.shadow))
    # the next real step is step 2 and uses step 2's decay
    trainer.train_step([_batch(3)])
    decay = _hand_decay(2, 0.9)
    expected = [decay * e + (1 - decay) * w for e, w in zip(after_first, _weights(trainer))]
    assert _close(trainer.ema.shadow, expected)


def test_ema_update_interval_is_respected(make_config):
    trainer = _trainer(make_config, ema_decay=0.9, ema_update_interval=2)
    start = _weights(trainer)
    trainer.train_step([_batch(1)])
    assert all(torch.equal(a, b) for a, b in zip(start, trainer.ema.shadow))  # step 1: no update
    trainer.train_step([_batch(2)])
    decay = _hand_decay(2, 0.9)  # the decay follows the step number
    expected = [decay * e + (1 - decay) * w for e, w in zip(start, _weights(trainer))]
    assert _close(trainer.ema.shadow, expected)
    trainer.train_step([_batch(3)])
    assert _close(trainer.ema.shadow, expected)  # step 3: no update


def test_decay_with_warmup_steps_copies_then_holds():
    assert [decay_at(t, 0.99, warmup_steps=3) for t in (1, 2, 3, 10)] == [0.0, 0.0, 0.99, 0.99]
    assert [decay_at(t, 0.5) for t in (1, 2, 9)] == [0.0, pytest.approx(2 / 11), 0.5]


def test_resume_restores_the_ema_exactly_and_the_final_ema_loads_in_diffusers(make_config, tmp_path, tiny_sd):
    from diffusers import StableDiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    common = dict(use_ema=True, ema_decay=0.5, checkpointing_steps=2)
    straight, result = train(make_config(max_train_steps=4, output_dir=str(tmp_path / "straight"), **common))
    out = str(tmp_path / "resumed")
    train(make_config(max_train_steps=2, output_dir=out, **common))
    assert (tmp_path / "resumed" / "checkpoint-2" / "ema.safetensors").is_file()
    resumed, _ = train(make_config(max_train_steps=4, output_dir=out, resume_from_checkpoint="latest", **common))

    want, got = straight.ema.state_dict(), resumed.ema.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    saved = load_file(tmp_path / "straight" / "checkpoint-4" / "ema.safetensors")
    assert all(torch.equal(saved[n], want[n]) for n in want)
    assert ckpt.verify_checkpoint(tmp_path / "straight" / "checkpoint-4") is None  # listed in the manifest

    # The final EMA adapter sits in output_dir/ema and the SD pipeline's load_lora_weights reads it.
    ema_file = tmp_path / "straight" / "ema" / "pytorch_lora_weights.safetensors"
    assert ema_file.is_file() and result.output_path.name == "pytorch_lora_weights.safetensors"
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_sd), safety_checker=None, requires_safety_checker=False)
    pipe.load_lora_weights(str(ema_file.parent), adapter_name="ema")
    loaded = get_peft_model_state_dict(pipe.unet, adapter_name="ema")
    by_peft_name = {n.replace(".default", ""): t for n, t in want.items()}
    assert loaded.keys() == by_peft_name.keys()
    for name, tensor in by_peft_name.items():
        assert torch.equal(loaded[name].float(), tensor.float()), name
    final = straight.accelerator.unwrap_model(straight.model)
    trained = {n: p for n, p in final.named_parameters() if p.requires_grad}
    assert any(not torch.equal(trained[n].cpu(), want[n]) for n in want)  # the EMA is not the last weights


def test_full_fine_tune_ema_covers_every_weight_and_saves_a_model_folder(make_config, tmp_path):
    from diffusers import UNet2DConditionModel

    trainer, _ = train(
        make_config(max_train_steps=2, training_type="full", use_ema=True, ema_device="cpu", learning_rate=1e-4)
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.ema.names == [n for n, _ in model.named_parameters()]
    unet = UNet2DConditionModel.from_pretrained(str(tmp_path / "output" / "ema" / "unet"))
    state = unet.state_dict()
    for name, tensor in trainer.ema.state_dict().items():
        assert torch.equal(state[name], tensor), name
