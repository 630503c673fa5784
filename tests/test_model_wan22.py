"""Wan 2.2 two-expert training on the tiny zoo model: detection, routing by timestep, one-side
sampling for train_stages high/low, per-expert parameter groups and rates, two adapter files
that WanPipeline loads back to the trained outputs, low_vram, the memory estimate."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from training_helpers import fixed_loss, train, untrained_loss

from simpletuner.configuration import validate_config
from simpletuner.models import get_model_spec
from simpletuner.models.wan import WAN_MAX_LENGTH
from simpletuner.models.wan22 import LORA_FILES, Wan22Spec, WanExperts
from simpletuner.testing.zoo import TINY_WAN_LATENT_CHANNELS as C
from simpletuner.testing.zoo import TINY_WAN_T5_WIDTH as WIDTH
from simpletuner.training.optim import build_optimizer

BOUNDARY = 875.0  # the zoo's boundary_ratio 0.875 x 1000 training timesteps


@pytest.fixture(scope="module")
def tiny_wan22(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_model

    return write_tiny_model("wan22", tmp_path_factory.mktemp("tiny_wan22") / "model")


@pytest.fixture
def wan22_config(make_config, tiny_wan22):
    def _make(**overrides):
        return make_config(**{"pretrained_model_name_or_path": str(tiny_wan22), "model_family": "wan", **overrides})

    return _make


def _inputs(batch: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, C, 1, 8, 8, generator=gen),
        encoder_hidden_states=torch.randn(batch, WAN_MAX_LENGTH, WIDTH, generator=gen),
    )


def test_a_two_expert_folder_gets_the_wan22_spec(wan22_config, tiny_wan22, make_config, tmp_path):
    spec = get_model_spec(validate_config(wan22_config()))
    assert isinstance(spec, Wan22Spec) and spec.boundary_ratio == 0.875 and spec.boundary_timestep == BOUNDARY
    assert spec.stages == ("high", "low") and spec.needs_unused_parameter_detection
    assert get_model_spec(validate_config(wan22_config(train_stages="low"))).stages == ("low",)
    model = spec.load_denoiser()
    assert isinstance(model, WanExperts) and model.boundary_timestep == BOUNDARY
    # Two experts with their own weights, in the order WanPipeline uses them.
    assert not torch.equal(model.transformer.proj_out.weight, model.transformer_2.proj_out.weight)

    # A Wan 2.1 folder (one transformer) refuses a stage; a one-denoiser family refuses it in the config.
    from simpletuner.testing.zoo import write_tiny_model

    wan21 = write_tiny_model("wan", tmp_path / "wan21")
    with pytest.raises(ValueError, match="train_stages 'high' picks one expert of Wan 2.2.*Wan 2.1"):
        get_model_spec(validate_config(wan22_config(pretrained_model_name_or_path=str(wan21), train_stages="high")))
    with pytest.raises(ValueError, match="train_stages 'low'.*'sd' has one denoiser"):
        validate_config(make_config(train_stages="low"))
    # A second expert without a usable boundary is a clear error.
    bad = tmp_path / "bad"
    shutil.copytree(tiny_wan22, bad)
    index = json.loads((bad / "model_index.json").read_text())
    index["boundary_ratio"] = None
    (bad / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="boundary_ratio is None"):
        get_model_spec(validate_config(wan22_config(pretrained_model_name_or_path=str(bad))))


def test_each_sample_runs_through_the_expert_its_timestep_belongs_to(wan22_config):
    spec = get_model_spec(validate_config(wan22_config()))
    model = spec.load_denoiser().eval()
    inputs = _inputs(4)
    timestep = torch.tensor([900.0, 10.0, 875.0, 874.0])  # 875 is the high expert's (t >= boundary)
    with torch.no_grad():
        got = model(timestep=timestep, **inputs)[0]
        high = model.transformer(timestep=timestep, **inputs, return_dict=False)[0]
        low = model.transformer_2(timestep=timestep, **inputs, return_dict=False)[0]
        routed = model(timestep=timestep, route=(True, False, True, False), **inputs)[0]
    want = torch.stack([high[0], low[1], high[2], low[3]])
    assert torch.allclose(got, want, atol=1e-6) and torch.equal(got, routed)
    assert not torch.allclose(high, low, atol=1e-3)


@pytest.mark.parametrize("stages", ["both", "high", "low"])
def test_timesteps_land_on_the_trained_side(wan22_config, stages):
    spec = get_model_spec(validate_config(wan22_config(train_stages=stages)))
    gen = torch.Generator().manual_seed(0)
    sigmas = torch.cat([spec.sample_sigmas(8, gen) for _ in range(50)])
    timesteps = sigmas * 1000
    if stages == "high":
        assert bool((timesteps >= BOUNDARY).all())
    elif stages == "low":
        assert bool((timesteps < BOUNDARY).all())
    else:  # the Wan 2.1 distribution: both sides (shift 3 puts ~40% above 875)
        share = float((timesteps >= BOUNDARY).float().mean())
        assert 0.2 < share < 0.6, share
    # The route of a draw says which expert owns each sample.
    last = spec.sample_sigmas(5, gen)
    assert spec.route(last) == tuple(bool(t) for t in (last * 1000 >= BOUNDARY))
    # training_loss hands the experts the route of its own draw (noise first, then the sigmas).
    model = spec.load_denoiser().eval()
    forward, seen = model.forward, []

    def recording(*args, route=None, **kwargs):
        seen.append(route)
        return forward(*args, route=route, **kwargs)

    model.forward = recording
    inputs = _inputs(5)
    latents, cond = inputs["hidden_states"], {"prompt_embeds": inputs["encoder_hidden_states"]}
    with torch.no_grad():
        spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    torch.randn(latents.shape, generator=gen)
    drawn = spec.sample_sigmas(5, gen)
    assert seen == [tuple(bool(t) for t in (drawn * 1000 >= BOUNDARY))]


def test_parameter_groups_carry_per_expert_rates(wan22_config):
    raw = wan22_config(
        optimizer="automagic",
        learning_rate=1e-4,
        high_noise_learning_rate=2e-4,
        low_noise_max_lr=5e-4,
        high_noise_min_lr=1e-5,
        lr_bump=2e-6,
        low_noise_lr_bump=3e-6,
    )
    cfg = validate_config(raw)
    spec = get_model_spec(cfg)
    model = spec.prepare_denoiser(spec.load_denoiser(), torch.float32)
    groups = spec.named_parameter_groups(model)
    assert list(groups) == ["high_noise", "low_noise"]
    high_ids = {id(p) for p in model.transformer.parameters() if p.requires_grad}
    assert {id(p) for p in groups["high_noise"]} == high_ids and high_ids
    assert all("lora" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = build_optimizer(cfg, groups)
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["high_noise"]["lr"] == 2e-4 and by_name["low_noise"]["lr"] == 1e-4
    assert by_name["high_noise"]["min_lr"] == 1e-5 and by_name["low_noise"]["min_lr"] == cfg.min_lr
    assert by_name["low_noise"]["max_lr"] == 5e-4 and by_name["high_noise"]["max_lr"] == cfg.max_lr
    assert by_name["high_noise"]["lr_bump"] == 2e-6 and by_name["low_noise"]["lr_bump"] == 3e-6

    adam = build_optimizer(validate_config(wan22_config(low_noise_learning_rate=3e-3)), groups)
    assert [(g["name"], g["lr"]) for g in adam.param_groups] == [("high_noise", 1e-3), ("low_noise", 3e-3)]
    assert "min_lr" not in adam.param_groups[0]
    with pytest.raises(ValueError, match="high_noise_min_lr 0.01 is greater than high_noise_max_lr"):
        validate_config(wan22_config(optimizer="automagic", learning_rate=1e-4, high_noise_min_lr=1e-2))


def test_both_experts_train_and_reload_in_wan_pipeline(wan22_config, tiny_wan22, tmp_path):
    from diffusers import WanPipeline

    opts = dict(learning_rate=1e-2, lora_rank=8, train_batch_size=4, high_noise_learning_rate=2e-2)
    trainer, result = train(
        wan22_config(max_train_steps=25, output_dir=str(tmp_path / "long"), logging_steps=25, **opts)
    )
    before, after = untrained_loss(trainer), fixed_loss(trainer)  # before: both adapters switched off
    assert after < before * 0.9, (before, after)
    by_name = {g["name"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert by_name == {"high_noise": 2e-2, "low_noise": 1e-2}

    out = result.output_path.parent
    assert result.output_path.name == LORA_FILES["high"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(LORA_FILES.values())
    from safetensors.torch import load_file

    for name in LORA_FILES.values():  # single-expert files: diffusers' transformer keys, as load_lora_weights wants
        keys = list(load_file(out / name))
        assert keys and all(k.startswith("transformer.") and not k.startswith("transformer_2.") for k in keys)
    pipe = WanPipeline.from_pretrained(str(tiny_wan22), use_safetensors=True)
    pipe.load_lora_weights(str(out), weight_name=LORA_FILES["high"], adapter_name="high")
    pipe.load_lora_weights(str(out), weight_name=LORA_FILES["low"], adapter_name="low", load_into_transformer_2=True)
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    base = WanPipeline.from_pretrained(str(tiny_wan22), use_safetensors=True)
    inputs = _inputs(2)
    timestep = torch.tensor([950.0, 300.0])
    with torch.no_grad():
        want = trained(timestep=timestep, **inputs)[0]
        for i, expert in ((0, pipe.transformer), (1, pipe.transformer_2)):
            got = expert(timestep=timestep, **inputs, return_dict=False)[0]
            assert torch.allclose(got[i], want[i], atol=1e-5)
        for i, expert in ((0, base.transformer), (1, base.transformer_2)):
            untrained = expert(timestep=timestep, **inputs, return_dict=False)[0]
            assert not torch.allclose(untrained[i], want[i], atol=1e-3), "each adapter must change its expert"


def test_one_stage_trains_one_expert_and_low_vram_parks_the_other(wan22_config, tmp_path):
    trainer, result = train(
        wan22_config(
            train_stages="high",
            low_vram=True,
            max_train_steps=3,
            validation_prompt="a red square",
            validation_num_inference_steps=2,
        )
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert list(model.parked) == ["transformer_2"]  # out of the module tree, in CPU RAM
    assert all(n.startswith("transformer.") for n, _ in model.named_parameters())
    assert not any("lora" in n for n, _ in model.expert("low").named_parameters())
    assert [g["name"] for g in trainer.optimizer.param_groups] == ["high_noise"]
    assert sorted(p.name for p in result.output_path.parent.glob("*.safetensors")) == [LORA_FILES["high"]]
    assert len(result.validation_images) == 2  # before and after: the parked expert samples the low-noise steps


def test_checkpoint_resume_is_exact_for_two_experts(wan22_config, tmp_path):
    opts = dict(optimizer="automagic", learning_rate=1e-4, high_noise_max_lr=2e-3, lr_bump=1e-5, train_batch_size=2)
    _, full = train(wan22_config(max_train_steps=4, output_dir=str(tmp_path / "full"), **opts))
    train(wan22_config(max_train_steps=2, checkpointing_steps=2, output_dir=str(tmp_path / "cut"), **opts))
    _, resumed = train(
        wan22_config(max_train_steps=4, resume_from_checkpoint="latest", output_dir=str(tmp_path / "cut"), **opts)
    )
    assert resumed.losses == full.losses[2:]
    from safetensors.torch import load_file

    for name in LORA_FILES.values():
        a, b = load_file(tmp_path / "full" / name), load_file(tmp_path / "cut" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_memory_estimate_counts_both_experts(wan22_config, make_config):
    from simpletuner.memory.estimator import estimate_memory

    both = estimate_memory(validate_config(wan22_config(mixed_precision="no")), device_kind="cpu")
    parked = estimate_memory(
        validate_config(wan22_config(mixed_precision="no", train_stages="high", low_vram=True)), device_kind="cpu"
    )
    one = estimate_memory(validate_config(wan22_config(mixed_precision="no", train_stages="high")), device_kind="cpu")
    low = estimate_memory(validate_config(wan22_config(mixed_precision="no", train_stages="low")), device_kind="cpu")
    # Both stages: an adapter on each expert; one stage: one adapter, the other expert frozen on the
    # device, or (low_vram) in CPU RAM and out of the estimate.
    assert both.trainable_weights == 2 * one.trainable_weights == 2 * parked.trainable_weights > 0
    assert both.weights - both.trainable_weights == one.weights - one.trainable_weights
    assert one.weights - parked.weights == parked.weights - parked.trainable_weights > 0  # twin experts
    # The low-noise expert alone: its step runs through the trained expert (twin of the high one).
    assert (low.weights, low.trainable_weights, low.activations) == (
        one.weights,
        one.trainable_weights,
        one.activations,
    )


def test_compile_compiles_each_expert_not_the_router(wan22_config):
    from simpletuner.training.knobs import maybe_compile

    spec = get_model_spec(validate_config(wan22_config()))
    model = spec.load_denoiser()
    assert maybe_compile(model, True) is model  # names (and checkpoints) unchanged
    assert model.transformer._compiled_call_impl is not None and model.transformer_2._compiled_call_impl is not None
    assert getattr(model, "_compiled_call_impl", None) is None


def test_lycoris_adapters_save_per_expert_and_reload(wan22_config, tmp_path):
    pytest.importorskip("lycoris", reason="the lycoris extra is not installed")
    from simpletuner.models.adapters.lycoris import load_lycoris

    trainer, result = train(
        wan22_config(lora_type="lycoris", lycoris={"algo": "lokr"}, lora_rank=4, max_train_steps=3, learning_rate=1e-2)
    )
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    out = result.output_path.parent
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(LORA_FILES.values())
    fresh = get_model_spec(validate_config(wan22_config())).load_denoiser().eval()
    inputs = _inputs(2)
    timestep = torch.tensor([950.0, 300.0])
    with torch.no_grad():
        base = fresh(timestep=timestep, **inputs)[0]
        for stage in ("high", "low"):
            load_lycoris(fresh.expert(stage), out / LORA_FILES[stage])
        want, got = trained(timestep=timestep, **inputs)[0], fresh(timestep=timestep, **inputs)[0]
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(base, want, atol=1e-4)


def test_the_frozen_expert_is_stored_as_the_trained_ones_base(wan22_config):
    from simpletuner.models.adapters.quantize import parameter_bytes

    plain = get_model_spec(validate_config(wan22_config(train_stages="high")))
    quant = get_model_spec(validate_config(wan22_config(train_stages="high", base_model_precision="int8_torchao")))
    a = plain.prepare_denoiser(plain.load_denoiser(), torch.float32)
    b = quant.prepare_denoiser(quant.load_denoiser(), torch.float32)
    assert parameter_bytes(b.expert("low")) < 0.6 * parameter_bytes(a.expert("low"))  # quantised too
    assert not any(p.requires_grad for p in b.expert("low").parameters())


def test_resume_refuses_another_base_precision_or_stage(wan22_config, tmp_path):
    out = str(tmp_path / "run")
    train(wan22_config(max_train_steps=2, checkpointing_steps=2, output_dir=out))
    with pytest.raises(ValueError, match="base_model_precision: checkpoint has 'no_change', config has 'qint8'"):
        train(
            wan22_config(
                max_train_steps=3, output_dir=out, resume_from_checkpoint="latest", base_model_precision="qint8"
            )
        )
    with pytest.raises(ValueError, match="train_stages: checkpoint has 'both', config has 'high'"):
        train(wan22_config(max_train_steps=3, output_dir=out, resume_from_checkpoint="latest", train_stages="high"))
