"""LyCORIS adapters (lora_type: lycoris) on the tiny SD UNet: training through the real Trainer,
the LyCORIS file format and its reload onto a fresh base, exact resume, estimator counts, errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

pytest.importorskip("lycoris", reason="the lycoris extra is not installed")

from training_helpers import fixed_loss, train  # noqa: E402

from simpletuner.configuration import validate_config  # noqa: E402
from simpletuner.models import get_model_spec  # noqa: E402
from simpletuner.models.adapters import prepare_for_training, trainable_state  # noqa: E402
from simpletuner.models.adapters.lycoris import load_lycoris, lycoris_network, save_lycoris  # noqa: E402
from simpletuner.training import checkpoint as ckpt  # noqa: E402

ALGOS = ["locon", "loha", "lokr"]
_PARAM_NAMES = {"locon": "lora_down.weight", "loha": "hada_w1_a", "lokr": "lokr_w1"}


def _lycoris_config(make_config, algo, **overrides):
    return make_config(lora_type="lycoris", lycoris={"algo": algo}, lora_rank=4, **overrides)


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 500]), torch.randn(2, 77, 32, generator=gen)


def _fresh_unet(raw):
    spec = get_model_spec(validate_config(raw))
    return spec.load_denoiser(torch.float32).requires_grad_(False).eval()


@pytest.mark.parametrize("algo", ALGOS)
def test_lycoris_trains_only_its_adapter_and_reloads_onto_a_fresh_base(make_config, tmp_path, algo):
    raw = _lycoris_config(make_config, algo, max_train_steps=16, learning_rate=1e-2)
    trainer, result = train(raw)
    model = trainer.accelerator.unwrap_model(trainer.model)
    network = lycoris_network(model)

    # Only the network trains, in fp32; every base weight is frozen.
    trained = trainable_state(model)
    assert trained and all(name.startswith("lycoris.") for name in trained), sorted(trained)[:3]
    assert all(p.dtype == torch.float32 for p in trained.values())
    assert any(_PARAM_NAMES[algo] in name for name in trained)
    assert not any(p.requires_grad for n, p in model.named_parameters() if not n.startswith("lycoris."))
    assert len(network.loras) == 32  # to_q, to_k, to_v, to_out.0 of 8 attention layers

    # Falling loss on a fixed batch: the adapter starts as the identity, so multiplier 0 is the base.
    network.set_multiplier(0.0)
    before = fixed_loss(trainer)
    network.set_multiplier(1.0)
    after = fixed_loss(trainer)
    assert after < before * 0.97, (before, after)

    # The file: LyCORIS keys and metadata; onto a fresh base it reproduces the trained denoiser.
    assert result.output_path.name == "pytorch_lora_weights.safetensors"
    with safe_open(str(result.output_path), "pt") as f:
        meta, keys = f.metadata(), list(f.keys())
    assert meta["lycoris_algo"] == algo and meta["ss_network_module"] == "lycoris.kohya"
    assert meta["simpletuner_model_family"] == "sd"
    assert json.loads(meta["ss_network_args"])["algo"] == algo and meta["ss_network_dim"] == "4"
    assert all(
        k.startswith("lycoris_down_blocks_") or k.startswith("lycoris_up_blocks_") or k.startswith("lycoris_mid_block_")
        for k in keys
    ), keys[:3]
    fresh = _fresh_unet(raw)
    loaded = load_lycoris(fresh, result.output_path)
    assert len(loaded.loras) == 32 and not any(p.requires_grad for p in fresh.parameters())
    x, t, ctx = _inputs()
    with torch.no_grad():
        want = model.eval()(x, t, ctx).sample
        got = fresh(x, t, ctx).sample
        base = _fresh_unet(raw)(x, t, ctx).sample
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    assert not torch.allclose(base, want, atol=1e-4), "the adapter must change the output"


def test_lycoris_resume_is_bit_identical(make_config, tmp_path):
    common = dict(gradient_accumulation_steps=2, lr_scheduler="linear", lr_warmup_steps=1)
    _, straight = train(
        _lycoris_config(make_config, "lokr", max_train_steps=5, output_dir=str(tmp_path / "straight"), **common)
    )
    out = str(tmp_path / "resumed")
    train(
        _lycoris_config(
            make_config,
            "lokr",
            max_train_steps=5,
            output_dir=out,
            checkpointing_steps=3,
            checkpoint_at_end=False,
            **common,
        )
    )  # as if stopped after step 3
    latest = ckpt.find_latest(Path(out))
    assert latest.name == "checkpoint-3"
    _, resumed = train(
        _lycoris_config(
            make_config, "lokr", max_train_steps=5, output_dir=out, resume_from_checkpoint=str(latest), **common
        )
    )
    assert resumed.losses == pytest.approx(straight.losses[3:], rel=0, abs=0)
    want, got = load_file(straight.output_path), load_file(resumed.output_path)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def _prepared(make_config, **overrides):
    cfg = validate_config(make_config(lora_type="lycoris", lora_rank=4, **overrides))
    spec = get_model_spec(cfg)
    return prepare_for_training(spec.load_denoiser(torch.float32), spec.lora_targets, cfg, torch.float32), cfg


def test_lycoris_starts_as_the_identity_and_takes_its_options(make_config):
    model, _ = _prepared(make_config, lycoris={"algo": "lokr"})
    x, t, ctx = _inputs()
    with torch.no_grad():
        assert torch.equal(model.eval()(x, t, ctx).sample, _fresh_unet(make_config())(x, t, ctx).sample)
    # LoKr: a full_matrix factor is a full matrix; a low-rank one a pair of rank-r matrices.
    default = dict(lycoris_network(model).named_parameters())
    full, _ = _prepared(make_config, lycoris={"algo": "lokr", "full_matrix": True, "factor": 4})
    params = dict(lycoris_network(full).named_parameters())
    assert params.keys() != default.keys() or any(params[k].shape != default[k].shape for k in params)
    assert all(name.split(".")[-1] in ("lokr_w1", "lokr_w2") for name in params)
    lokr_w1 = next(p for n, p in params.items() if n.endswith("lokr_w1"))
    assert lokr_w1.shape == (4, 4)  # factor 4: the small Kronecker factor is 4 x 4


def test_lycoris_set_up_errors(make_config, monkeypatch):
    with pytest.raises(ValueError, match="match no module"):
        _prepared(make_config, lora_target_modules=["no_such_layer"])
    with pytest.raises(ValueError, match="lora_use_dora is for lora_type 'standard'"):
        _prepared(make_config, lora_use_dora=True)
    unet = _fresh_unet(make_config())
    with pytest.raises(ValueError, match="has no LyCORIS network"):
        save_lycoris(unet, "/nonexistent/x.safetensors")
    monkeypatch.setitem(sys.modules, "lycoris", None)  # the extra not installed
    with pytest.raises(ValueError, match=r'pip install -e "\.\[lycoris\]" in the simpletuner checkout'):
        _prepared(make_config)


def test_load_refuses_a_file_for_another_model(make_config, tmp_path):
    model, _ = _prepared(make_config, lycoris={"algo": "locon"})
    path = save_lycoris(model, tmp_path / "a.safetensors", {"note": "x"})
    weights = load_file(path)
    weights["lycoris_not_a_layer.lora_down.weight"] = torch.zeros(4, 32)
    weights["lycoris_not_a_layer.lora_up.weight"] = torch.zeros(32, 4)
    weights["lycoris_not_a_layer.alpha"] = torch.tensor(4.0)
    from safetensors.torch import save_file

    save_file(weights, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="match no layer"):
        load_lycoris(_fresh_unet(make_config()), tmp_path / "b.safetensors")


@pytest.mark.parametrize("algo", ALGOS)
def test_estimator_counts_the_lycoris_adapter_exactly(make_config, algo):
    from simpletuner.memory.estimator import estimate_memory

    model, cfg = _prepared(make_config, lycoris={"algo": algo}, mixed_precision="bf16")
    real = trainable_state(model)
    estimate = estimate_memory(cfg, device_kind="cpu")
    assert estimate.num_trainable_parameters == sum(p.numel() for p in real.values())
    assert estimate.trainable_weights == sum(p.nbytes for p in real.values())
    assert estimate.adapter == f"lycoris {algo} r4"
