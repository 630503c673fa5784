"""Quantised base weights (base_model_precision) under a peft LoRA or LyCORIS on the tiny SD UNet:
the Linear weights really become 8-bit (or 4- / 2-bit, packed), adapters train in fp32 on CPU, the saved LoRA
loads into diffusers on an unquantised base, the estimator counts the quantised weights, and the set-up errors."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from training_helpers import fixed_loss, train

from simpletuner.configuration import validate_config
from simpletuner.models import get_model_spec
from simpletuner.models.adapters import prepare_for_training, trainable_state
from simpletuner.models.adapters.quantize import parameter_bytes, quantizable_linears, quantize_base, tensor_bytes

QUANTO = ["qint8", "qfloat8", "qint4", "qint2"]
TORCHAO = ["int8_torchao", "fp8_torchao"]
_DATA_DTYPES = {
    "qint8": torch.int8,
    "qfloat8": torch.float8_e4m3fn,
    "qint4": torch.uint8,  # 2 values a byte
    "qint2": torch.uint8,  # 4 values a byte
    "int8_torchao": torch.int8,
    "fp8_torchao": torch.float8_e4m3fn,
}


def _needs(precision):
    pytest.importorskip(
        "optimum.quanto" if precision in QUANTO else "torchao.quantization",
        reason=f"the extra for {precision} is not installed",
    )


def _prepared(make_config, precision, **overrides):
    cfg = validate_config(make_config(base_model_precision=precision, lora_rank=4, mixed_precision="bf16", **overrides))
    spec = get_model_spec(cfg)
    unet = spec.load_denoiser(torch.bfloat16).requires_grad_(False)
    linears = {name: layer.weight.nbytes for name, layer in quantizable_linears(unet).items()}
    return prepare_for_training(unet, spec.lora_targets, cfg, torch.bfloat16), linears


def _data(weight: torch.Tensor) -> torch.Tensor:
    """The 8-bit payload of a quantised weight (quanto ``_data``, torchao ``qdata``)."""
    return weight._data if hasattr(weight, "_data") else weight.qdata


@pytest.mark.parametrize("lora_type", ["standard", "lycoris"])
@pytest.mark.parametrize("precision", QUANTO + TORCHAO)
def test_base_is_quantised_and_the_fp32_adapter_trains_on_it(make_config, precision, lora_type):
    _needs(precision)
    if lora_type == "lycoris":
        pytest.importorskip("lycoris")
    model, linears = _prepared(make_config, precision, lora_type=lora_type, lycoris={"algo": "locon"})

    # Every frozen Linear of the base is 8-bit now (quanto swaps the layer, torchao the weight);
    # convolutions keep bf16, and the quantised weights take about half their bf16 bytes.
    layers = dict(model.named_modules())
    quantised = {}
    for name in linears:
        layer = layers[name]
        if lora_type == "standard" and not isinstance(layer, nn.Linear):
            layer = layer.base_layer  # wrapped by peft: the quantised layer sits inside
        if precision in QUANTO:
            assert type(layer).__name__ == "QLinear", name
        else:
            assert type(layer.weight).__name__ in ("Int8Tensor", "Float8Tensor"), name
        assert _data(layer.weight).dtype == _DATA_DTYPES[precision], name
        assert not layer.weight.requires_grad
        quantised[name] = tensor_bytes(layer.weight)
    assert len(quantised) == len(linears) > 30
    # 8 bits: about half the bf16 bytes; 4 / 2 bits: a quarter / an eighth, plus a scale and shift per group.
    share = {"qint4": 0.25, "qint2": 0.125}.get(precision, 0.5) + 0.1
    assert sum(quantised.values()) < share * sum(linears.values()), (sum(quantised.values()), sum(linears.values()))
    assert all(m.weight.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, nn.Conv2d))

    # Only the adapter trains, in fp32; a few steps on a fixed batch under bf16 autocast lower the loss.
    trained = trainable_state(model)
    assert trained and all(p.dtype == torch.float32 for p in trained.values())
    assert all(("lora_" in n) or n.startswith("lycoris.") for n in trained)
    gen = torch.Generator().manual_seed(0)
    x, t, ctx = torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 500]), torch.randn(2, 77, 32, generator=gen)
    optimizer = torch.optim.AdamW(list(trained.values()), lr=1e-2)
    losses = []
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, t, ctx).sample
        loss = (out.float() - x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("precision", ["qint8", "int8_torchao", "qint4", "qint2"])
def test_quantised_base_lora_trains_in_the_trainer_and_loads_into_diffusers(make_config, tmp_path, precision):
    _needs(precision)
    from diffusers import StableDiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    raw = make_config(
        base_model_precision=precision,
        mixed_precision="bf16",
        max_train_steps=16,
        learning_rate=1e-2,
        lora_rank=4,
        output_dir=str(tmp_path / precision),
    )
    trainer, result = train(raw)
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert parameter_bytes(model) < parameter_bytes(get_model_spec(trainer.config).load_denoiser(torch.bfloat16))
    model.disable_adapters()  # the LoRA starts as the identity: without it is the base
    before = fixed_loss(trainer)
    model.enable_adapters()
    after = fixed_loss(trainer)
    assert after < before * 0.97, (before, after)

    # The file is diffusers' LoRA format: it loads onto the unquantised base and carries exactly the trained adapter.
    pipe = StableDiffusionPipeline.from_pretrained(raw["pretrained_model_name_or_path"], safety_checker=None)
    pipe.load_lora_weights(str(result.output_path.parent))
    (loaded_name,) = pipe.unet.peft_config
    want, got = get_peft_model_state_dict(model), get_peft_model_state_dict(pipe.unet, adapter_name=loaded_name)
    assert want.keys() == got.keys() and len(want) == 64
    assert all(torch.equal(want[k].float(), got[k]) for k in want)
    gen = torch.Generator().manual_seed(1)
    x, t, ctx = torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 500]), torch.randn(2, 77, 32, generator=gen)
    with torch.no_grad():
        adapted = pipe.unet(x, t, ctx).sample
        pipe.unet.disable_lora()
        base = pipe.unet(x, t, ctx).sample
    assert torch.isfinite(adapted).all() and not torch.allclose(adapted, base, atol=1e-4)


@pytest.mark.parametrize("precision", ["qint8", "int8_torchao", "qint4", "qint2"])
def test_estimator_counts_quantised_linear_weights_at_their_packed_size(make_config, precision):
    _needs(precision)
    from simpletuner.memory.estimator import estimate_memory

    model, _ = _prepared(make_config, precision)
    real = parameter_bytes(model) + sum(b.nbytes for b in model.buffers())
    cfg = validate_config(make_config(base_model_precision=precision, lora_rank=4, mixed_precision="bf16"))
    estimate = estimate_memory(cfg, device_kind="cpu")
    assert estimate.weights == pytest.approx(real, rel=0.01), (estimate.weights, real)
    unquantised = get_model_spec(cfg).load_denoiser(torch.bfloat16)
    assert estimate.weights < parameter_bytes(unquantised) + sum(b.nbytes for b in unquantised.buffers())
    assert estimate.adapter == f"lora r4 on a {precision} base"


def test_what_is_left_unquantised():
    class Block(nn.Module):
        _keep_in_fp32_modules = ["time_embedder"]

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.time_embedder = nn.Sequential(nn.Linear(8, 8))
            self.conv = nn.Conv2d(8, 8, 1)
            self.adapter = nn.Linear(8, 8)  # trainable: never quantised

    block = Block().requires_grad_(False)
    block.adapter.requires_grad_(True)
    assert list(quantizable_linears(block)) == ["proj"]
    with torch.device("meta"):  # the memory estimator's model: nothing to quantise yet
        meta = Block().requires_grad_(False)
    assert quantize_base(meta, "qint8") == 0 and type(meta.proj.weight) is nn.Parameter
    assert quantize_base(block, "no_change") == 0
    with pytest.raises(ValueError, match="is not one of"):
        quantize_base(block, "int4")


def test_dora_on_a_quanto_base_is_refused(make_config):
    with pytest.raises(ValueError, match="lora_use_dora with base_model_precision 'qint8'.*int8_torchao"):
        _prepared(make_config, "qint8", lora_use_dora=True)


@pytest.mark.parametrize(
    "precision, modules, extra",
    [
        ("qint8", ["optimum.quanto", "optimum.quanto.nn"], "quanto"),
        ("qfloat8", ["optimum.quanto", "optimum.quanto.nn"], "quanto"),
        ("int8_torchao", ["torchao", "torchao.quantization"], "torchao"),
        ("fp8_torchao", ["torchao", "torchao.quantization"], "torchao"),
    ],
)
def test_a_missing_library_names_its_extra(make_config, monkeypatch, precision, modules, extra):
    for name in modules:  # importing them now fails, as where the extra is not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ValueError, match=rf'{precision}.*pip install -e "\.\[{extra}\]" in the simpletuner checkout'):
        _prepared(make_config, precision)
