"""The optimizers SimpleTuner users rely on, under its names (`optimi-*` from torch-optimi, `bnb-adamw8bit`,
`bnb-adamw8bit-paged`, `bnb-lion8bit` from bitsandbytes, `torch-adafactor`), and 4- / 2-bit quanto bases
(`qint4`, `qint2`: SimpleTuner's `int4-quanto`, `int2-quanto`; a LoRA on them in the trainer, loaded into
diffusers, and their estimate: tests/test_quantize.py).

Each optimizer is held to SimpleTuner's own construction: its class built with its `default_settings`
(helpers/training/optimizer_param.py at the dialect's commit, written here as figures) steps bit for bit as the one
a config builds; its state resumes exactly through a checkpoint file; the estimator counts its state bytes.
"""

from __future__ import annotations

import io
import json
import sys
import warnings

import pytest
import torch
from torch import nn

from simpletuner.configuration import validate_config
from simpletuner.training.optim import build_optimizer

optimi = pytest.importorskip("optimi", reason="the optimi extra is not installed")
bnb = pytest.importorskip("bitsandbytes", reason="the bitsandbytes extra is not installed")

#: SimpleTuner's class and `default_settings` of each name (optimizer_param.py line of the entry).
SIMPLETUNER = {
    "optimi-stableadamw": (  # :302
        optimi.StableAdamW,
        dict(betas=(0.9, 0.99), weight_decay=1e-2, eps=1e-6, decouple_lr=False, max_lr=None, kahan_sum=True),
    ),
    "optimi-adamw": (  # :315
        optimi.AdamW,
        dict(betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0, decouple_lr=False, kahan_sum=True, max_lr=None),
    ),
    "optimi-lion": (  # :327
        optimi.Lion,
        dict(betas=(0.9, 0.99), weight_decay=0.0, decouple_lr=False, max_lr=None, kahan_sum=True),
    ),
    "optimi-radam": (  # :339
        optimi.RAdam,
        dict(betas=(0.9, 0.99), weight_decay=0.0, eps=1e-6, decouple_wd=True, decouple_lr=False, kahan_sum=True),
    ),
    "optimi-ranger": (  # :352
        optimi.Ranger,
        dict(betas=(0.9, 0.99), weight_decay=0.0, eps=1e-6, k=6, alpha=0.5, decouple_wd=True, kahan_sum=True),
    ),
    "optimi-adan": (  # :368
        optimi.Adan,
        dict(betas=(0.98, 0.92, 0.999), weight_decay=2e-2, eps=1e-6, decouple_lr=False, adam_wd=False, kahan_sum=True),
    ),
    "optimi-adam": (  # :382
        optimi.Adam,
        dict(betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0, decouple_wd=False, decouple_lr=False, kahan_sum=True),
    ),
    "optimi-sgd": (  # :395
        optimi.SGD,
        dict(momentum=0, weight_decay=0.0, dampening=False, decouple_wd=False, torch_init=False, kahan_sum=True),
    ),
    "bnb-adamw8bit": (bnb.optim.AdamW8bit, dict(betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-6)),  # :589
    "bnb-adamw8bit-paged": (bnb.optim.PagedAdamW8bit, dict(betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-6)),  # :607
    "bnb-lion8bit": (bnb.optim.Lion8bit, dict(betas=(0.9, 0.99), weight_decay=0.0, min_8bit_size=4096)),  # :625
    "torch-adafactor": (  # :154
        torch.optim.Adafactor,
        dict(beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0),
    ),
}
NAMES = list(SIMPLETUNER)
#: Shapes of the test parameters: 2-D over bitsandbytes' 4096-element 8-bit threshold, one under it, 1-D, 4-D.
SHAPES = ((64, 80), (16, 8), (24,), (4, 3, 3, 3))
LR = 3e-3


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _run(opt, params, steps, start=0):
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _native(make_config, name, **overrides):
    return validate_config(make_config(optimizer=name, learning_rate=LR, **overrides))


def _simpletuners(name, params):
    cls, settings = SIMPLETUNER[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(params, lr=LR, **settings)


# --- the same optimizer as SimpleTuner builds ---------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_named_optimizers_are_the_library_classes_with_simpletuners_defaults(make_config, name, dtype):
    """A config naming the optimizer, nothing else set, steps exactly as SimpleTuner's class with its defaults
    (bf16 weights too: the optimi ones Kahan-sum there, as SimpleTuner's do)."""
    if dtype == torch.bfloat16 and name == "torch-adafactor":
        pytest.skip("torch's Adafactor on bf16 weights is torch's own business; nothing of ours differs")
    ours_params, theirs_params = _params(dtype), _params(dtype)
    ours = build_optimizer(_native(make_config, name), ours_params)
    theirs = _simpletuners(name, theirs_params)
    assert type(ours) is type(theirs) is SIMPLETUNER[name][0]
    for step in range(3):
        _run(ours, ours_params, 1, start=step)
        _run(theirs, theirs_params, 1, start=step)
        assert all(torch.equal(p, q) for p, q in zip(ours_params, theirs_params)), (name, step)
    assert not torch.equal(ours_params[0], _params(dtype)[0])  # it moved
    if name.startswith("optimi-") and dtype == torch.bfloat16:
        assert ours.state[ours_params[0]]["kahan_comp"] is not None


def test_the_config_keys_reach_the_optimizer_over_simpletuners_defaults(make_config):
    config = _native(
        make_config,
        "optimi-adan",
        adam_beta1=0.9,
        adam_beta2=0.9,
        adam_epsilon=1e-7,
        weight_decay=0.1,
        optimizer_config="beta3=0.99,adam_wd=true,decouple_lr=true,max_lr=0.01",
    )
    group = build_optimizer(config, _params(torch.float32)).param_groups[0]
    assert (group["beta1"], group["beta2"], group["beta3"], group["eps"]) == (0.9, 0.9, 0.99, 1e-7)
    assert group["adam_wd"] and group["decouple_lr"] and group["max_lr"] == 0.01 and group["weight_decay"] == 0.1
    # A learning rate per param group (Wan 2.2's experts), as every optimizer here takes it.
    params = _params(torch.float32)
    config = _native(make_config, "bnb-adamw8bit", optimizer_config={"min_8bit_size": 100})
    opt = build_optimizer(config, {"high_noise": params[:2], "low_noise": params[2:]})
    assert [g["lr"] for g in opt.param_groups] == [LR, LR] and opt.param_groups[0]["eps"] == 1e-6
    _run(opt, params, 1)
    assert opt.state[params[1]]["state1"].dtype == torch.uint8  # 128 elements, 8-bit under min_8bit_size 100
    adafactor = _native(make_config, "torch-adafactor", optimizer_config={"eps1": 1e-30, "d": 2.0})
    assert build_optimizer(adafactor, _params(torch.float32)).param_groups[0]["eps"] == (1e-30, 1e-3)


def test_native_defaults_are_simpletuners_where_the_config_is_silent(make_config):
    lion = _native(make_config, "optimi-lion")
    assert (lion.adam_beta1, lion.adam_beta2, lion.weight_decay) == (0.9, 0.99, 0.0)
    radam = _native(make_config, "optimi-radam", optimizer_config="decouple_lr=true")
    assert radam.optimizer_config == {"decouple_lr": True, "decouple_wd": True}
    assert _native(make_config, "optimi-radam", optimizer_config={"decouple_wd": False}).optimizer_config == {
        "decouple_wd": False
    }
    assert _native(make_config, "optimi-sgd").optimizer_config == {"momentum": 0.0}
    assert _native(make_config, "bnb-adamw8bit", weight_decay=0.3).weight_decay == 0.3
    plain = _native(make_config, "adamw")  # our own names keep our defaults
    assert (plain.adam_beta2, plain.adam_epsilon, plain.weight_decay) == (0.999, 1e-8, 1e-2)


def test_settings_are_checked_before_anything_loads(make_config):
    from training_helpers import config_problems

    text = config_problems(
        make_config(optimizer="optimi-lion", optimizer_config="eps=1e-6,decouple_wd=true,max_lr=-1,kahan_sum=3")
    )
    assert "optimizer_config.eps: set it with `adam_epsilon`" in text
    assert "optimizer_config.decouple_wd is not a setting of optimizer 'optimi-lion'" in text
    assert "optimizer_config.max_lr is -1; it must be null or a number > 0" in text
    assert "optimizer_config.kahan_sum is 3; it must be null or true or false" in text
    text = config_problems(make_config(optimizer="optimi-ranger", optimizer_config={"k": 0, "alpha": 1.5}))
    assert "optimizer_config.k is 0; it must be a whole number >= 1" in text and "alpha is 1.5" in text
    text = config_problems(make_config(optimizer="torch-adafactor", optimizer_config={"eps": 1e-3, "beta2_decay": 0.5}))
    assert "torch-adafactor's epsilons are a pair here: set `eps1` and `eps2`" in text
    assert "beta2_decay is 0.5; it must be a number <= 0" in text
    assert "min_8bit_size is 0" in config_problems(
        make_config(optimizer="bnb-lion8bit", optimizer_config="min_8bit_size=0")
    )
    assert "gradient_release is not a setting" in config_problems(
        make_config(optimizer="optimi-adamw", optimizer_config="gradient_release=true")
    )


@pytest.mark.parametrize(
    "module, name, extra", [("optimi", "optimi-lion", "optimi"), ("bitsandbytes", "bnb-adamw8bit", "bitsandbytes")]
)
def test_a_missing_library_names_its_extra(make_config, monkeypatch, module, name, extra):
    monkeypatch.setitem(sys.modules, module, None)  # importing it now fails, as where the extra is not installed
    monkeypatch.delitem(sys.modules, f"{module}.optim", raising=False)
    config = validate_config(make_config(optimizer=name, learning_rate=LR), check_files=False)  # the builder's own
    with pytest.raises(ValueError, match=rf'{name}.*pip install -e "\.\[{extra}\]" in the simpletuner checkout'):
        build_optimizer(config, _params(torch.float32))
    # the config check says it first, before anything loads (tests/test_trackers_and_paths.py)
    with pytest.raises(ValueError, match=rf"optimizer: '{name}' needs the"):
        _native(make_config, name)


def test_simpletuners_removed_optimizers_stop_with_its_reason(tmp_path):
    from simpletuner.configuration.simpletuner import translate as dialect

    for name, fix in (("adafactor", "torch-adafactor"), ("adamw8bit", "bnb-adamw8bit")):
        with pytest.raises(dialect.DialectError, match=rf"'{name}': SimpleTuner itself stops on it.*`{fix}`"):
            dialect.translate({"--optimizer": name, "--pretrained_model_name_or_path": str(tmp_path)}, cwd=tmp_path)


# --- checkpoints and the estimate -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_state_resumes_exactly_through_a_file(make_config, name):
    """Three steps, the state through torch.save / torch.load(weights_only=True) into a fresh optimizer (as a
    checkpoint holds it), three more: the same weights as six uninterrupted steps."""
    dtype = torch.float32 if name == "torch-adafactor" else torch.bfloat16
    config = _native(make_config, name)
    params = _params(dtype)
    opt = build_optimizer(config, params)
    _run(opt, params, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed_params = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = build_optimizer(config, resumed_params)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    _run(opt, params, 3, start=3)
    _run(resumed, resumed_params, 3, start=3)
    assert all(torch.equal(p, q) for p, q in zip(params, resumed_params))


def _state_bytes(opt) -> int:
    """Bytes of the state tensors the optimizer keeps on the parameters' device (torch's Adafactor's step
    counter is a CPU scalar however the parameters are placed: not counted)."""
    return sum(
        t.nbytes
        for st in opt.state.values()
        for k, t in st.items()
        if isinstance(t, torch.Tensor) and not (k == "step" and t.dim() == 0)
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_estimate_counts_the_state_each_library_keeps(make_config, name, dtype):
    from simpletuner.memory.estimator import optimizer_bytes

    config = _native(make_config, name, **({"optimizer_config": {"momentum": 0.9}} if name == "optimi-sgd" else {}))
    params = _params(dtype)
    opt = build_optimizer(config, params)
    _run(opt, params, 1)
    state, temporaries = optimizer_bytes(config, params, "cuda")
    assert state == _state_bytes(opt), name
    if name.startswith("bnb-"):  # uint8 codes for the parameter over 4096 elements, fp32 for the smaller ones
        assert opt.state[params[0]]["state1"].dtype == torch.uint8
        assert opt.state[params[1]]["state1"].dtype == torch.float32
    assert temporaries >= 0


def test_the_estimate_for_a_tiny_lora_with_each_kind_of_state(make_config):
    """The estimator's breakdown on the tiny SD LoRA: Lion keeps half of AdamW's state, 8-bit AdamW less."""
    from simpletuner.memory.estimator import estimate_memory

    adamw = estimate_memory(validate_config(make_config(optimizer="adamw", lora_rank=64)), device_kind="cpu")
    lion = estimate_memory(validate_config(make_config(optimizer="optimi-lion", lora_rank=64)), device_kind="cpu")
    eight_bit = make_config(optimizer="bnb-adamw8bit", lora_rank=64, optimizer_config={"min_8bit_size": 256})
    eight = estimate_memory(validate_config(eight_bit), device_kind="cpu")
    assert lion.optimizer_state * 2 == adamw.optimizer_state
    # The tiny LoRA's small matrices pay each state's 1 KiB code map: under half of AdamW's 8 bytes a weight here.
    assert eight.optimizer_state < 0.5 * adamw.optimizer_state


# --- in the trainer ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["optimi-lion", "bnb-adamw8bit", "torch-adafactor"])
def test_a_tiny_lora_trains_and_resumes_exactly(make_config, tmp_path, name):
    from safetensors.torch import load_file
    from training_helpers import same_weights, straight_and_resumed

    common = dict(optimizer=name, learning_rate=1e-3, optimizer_config={"min_8bit_size": 64} if "bnb" in name else {})
    (_, straight), (resumed, result) = straight_and_resumed(make_config, tmp_path, 3, 2, **common)
    assert result.losses == straight.losses[2:]
    weights = load_file(straight.output_path)
    assert same_weights(weights, load_file(result.output_path))
    ups = [t for k, t in weights.items() if "lora_B" in k or ".up." in k]
    assert ups and all(t.abs().sum() > 0 for t in ups)  # the zero-initialised up-projections trained
    if name == "bnb-adamw8bit":
        inner = getattr(resumed.optimizer, "optimizer", resumed.optimizer)
        assert any(st["state1"].dtype == torch.uint8 for st in inner.state.values())


# --- 4- and 2-bit bases ------------------------------------------------------------------------------------------
def test_int4_layers_the_cpu_kernel_cannot_pack_keep_quantos_portable_form():
    """torch's CPU int4 packing needs out_features a multiple of 16 (real models' are): such a layer keeps quanto's
    unpacked tensor, the same values. Inputs reach every 4-bit layer in its dtype and contiguous, as its kernel
    needs (an fp32 LayerNorm output under bf16 autocast, a strided view)."""
    pytest.importorskip("optimum.quanto", reason="the quanto extra is not installed")
    from simpletuner.models.adapters.quantize import qbits_bytes, quantize_base, quantized_size, tensor_bytes

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.packed = nn.Linear(256, 32)  # bf16, groups of 128, N % 16 == 0: torch's CPU int4 kernel
            self.ragged = nn.Linear(256, 24)  # N % 16 != 0: the portable form
            self.norm = nn.LayerNorm(24)
            self.out = nn.Linear(24, 256)

        def forward(self, x):
            return self.out(self.norm(self.ragged(x) + self.packed(x)[..., :24]))

    torch.manual_seed(0)
    block = Block().to(torch.bfloat16).requires_grad_(False)
    reference = Block().to(torch.bfloat16)
    reference.load_state_dict(block.state_dict())
    _, estimated = quantized_size(block, "qint4")
    assert quantize_base(block, "qint4") == 3
    assert type(block.packed.weight).__name__ == "TinyGemmWeightQBitsTensor"
    assert type(block.ragged.weight).__name__ == "WeightQBitsTensor"
    assert estimated == sum(tensor_bytes(m.weight) for m in (block.packed, block.ragged, block.out))
    assert qbits_bytes(block.ragged.weight, 4) == 256 * 24 // 2 + 2 * 48 * 2  # groups of 128: 48 scales, 48 shifts
    x = torch.randn(3, 512).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x[:, ::2])  # a strided view
        want = reference(x[:, ::2])
    y.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert (y.float() - want.float()).abs().max() < 0.25 * want.float().abs().max()  # 4-bit rounding, not garbage


# --- a published SimpleTuner example that uses them ---------------------------------------------------------------
@pytest.mark.slow
def test_simpletuners_qwen_image_example_trains_with_int2_quanto_and_optimi_lion(tmp_path, zoo, monkeypatch):
    """simpletuner/examples/qwen_image.peft-lora/config.json (SimpleTuner bc8e6ab), keys as published; the model is
    the tiny Qwen-Image, its Hub dataset a local folder of the same kind (one 1024 px image). It trains here with
    `int2-quanto` and `optimi-lion` in place (for time: one step, no validation renders, through `--set`)."""
    pytest.importorskip("optimum.quanto", reason="the quanto extra is not installed")
    from simpletuner.cli import main
    from simpletuner.configuration import load_config
    from simpletuner.testing.demo_data import write_shapes_dataset

    root = tmp_path / "simpletuner"
    write_shapes_dataset(root / "datasets" / "dreambooth", num_images=1, sizes=((1024, 1024),))
    datasets = [
        {
            "id": "dreambooth-1024",
            "type": "local",
            "instance_data_dir": "datasets/dreambooth",
            **{"crop": True, "crop_style": "random", "crop_aspect": "square"},
            **{"minimum_image_size": 256, "maximum_image_size": 1024, "target_downsample_size": 1024},
            **{"resolution": 1024, "resolution_type": "pixel_area", "caption_strategy": "instanceprompt"},
            **{"instance_prompt": "🟫", "cache_dir_vae": "cache/vae/{model_family}/dreambooth-1024"},
        },
        {"id": "alt-embed-cache", "dataset_type": "text_embeds", "default": True, "type": "local"}
        | {"cache_dir": "cache/text/{model_family}"},
    ]
    (root / "config").mkdir()
    (root / "config" / "multidatabackend.json").write_text(json.dumps(datasets))
    config = {
        **{"base_model_precision": "int2-quanto", "caption_dropout_probability": 0.0, "checkpoint_step_interval": 50},
        **{"checkpoints_total_limit": 5, "compress_disk_cache": False, "disable_benchmark": True},
        **{"data_backend_config": "config/multidatabackend.json", "disable_bucket_pruning": True},
        **{"flow_schedule_shift": 1.73, "gradient_checkpointing": True, "strict_epoch_limit": False},
        **{"hub_model_id": "simpletuner-example-qwen_image-peft-lora", "learning_rate": 1e-4, "lora_alpha": 8},
        **{"lora_rank": 8, "lora_type": "standard", "lr_scheduler": "constant_with_warmup", "lr_warmup_steps": 10},
        **{"max_grad_norm": 0.01, "max_train_steps": 100, "minimum_image_size": 0, "mixed_precision": "bf16"},
        **{"model_family": "qwen_image", "model_flavour": "v1.0", "model_type": "lora", "num_eval_images": 25},
        **{"num_train_epochs": 0, "optimizer": "optimi-lion", "output_dir": "output/examples/qwen_image.peft-lora"},
        **{"push_checkpoints_to_hub": False, "push_to_hub": False, "quantize_via": "cpu"},
        **{"quantize_activations": False, "report_to": "none", "resolution": 1024, "resolution_type": "pixel_area"},
        **{"resume_from_checkpoint": "latest", "seed": 42, "skip_file_discovery": False},
        **{"tracker_project_name": "lora-training", "tracker_run_name": "example-training-run"},
        **{"train_batch_size": 1, "use_ema": False, "vae_batch_size": 1, "validation_guidance": 4.0},
        **{"validation_guidance_rescale": 0.0, "validation_lycoris_strength": 1.0},
        "validation_negative_prompt": "ugly, cropped, blurry, low-quality, mediocre average",
        **{"validation_num_inference_steps": 30, "validation_prompt_library": False},
        "validation_prompt": "🟫 is holding a sign that says hello world from qwen_image",
        **{"validation_resolution": "1024x1024", "validation_seed": 42, "validation_steps": 50},
        "pretrained_model_name_or_path": str(zoo("qwen_image")),  # the tiny model in place of the flavour's
    }
    path = root / "config" / "config.json"
    path.write_text(json.dumps(config, ensure_ascii=False))
    monkeypatch.chdir(root)
    loaded = load_config(path).config
    assert (loaded.optimizer, loaded.base_model_precision) == ("optimi-lion", "qint2")
    assert (loaded.adam_beta1, loaded.adam_beta2, loaded.weight_decay, loaded.max_grad_norm) == (0.9, 0.99, 0.0, 0.01)
    overrides = ["--set", "max_train_steps=1", "--set", "validation_prompt=null", "--set", "validation_steps=null"]
    assert main(["train", "--config", str(path), *overrides]) == 0
    assert list((root / "output" / "examples" / "qwen_image.peft-lora").glob("*.safetensors"))
