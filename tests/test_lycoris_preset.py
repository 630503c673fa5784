"""`lycoris.apply_preset` (SimpleTuner's lycoris_config.json): classes and names pick the layers, per-class
settings reach the LyCORIS modules, a preset naming nothing stops before training; multiplier, bypass_mode,
conv_dim."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("lycoris", reason="the lycoris extra is not installed")

from simpletuner.configuration import ConfigError, validate_config  # noqa: E402
from simpletuner.models import get_model_spec  # noqa: E402
from simpletuner.models.adapters import prepare_for_training  # noqa: E402
from simpletuner.models.adapters.lycoris import lycoris_network  # noqa: E402


def _config(make_config, lycoris: dict, **overrides):
    return validate_config(make_config(lora_type="lycoris", lycoris=lycoris, lora_rank=4, **overrides))


def _adapted(make_config, lycoris: dict, **overrides):
    """The tiny SD UNet with the LyCORIS network the config describes; (unet, {layer path: module})."""
    config = _config(make_config, lycoris, **overrides)
    spec = get_model_spec(config)
    unet = prepare_for_training(spec.load_denoiser(torch.float32), spec.lora_targets, config, torch.float32)
    modules = {m.lora_name.removeprefix("lycoris_"): m for m in lycoris_network(unet).loras}
    return unet, modules


def _layers_inside(unet: nn.Module, class_name: str) -> set[str]:
    """Paths (with ``_``, as LyCORIS names them) of the Linear / Conv layers inside modules of ``class_name``."""
    found = set()
    for path, module in unet.named_modules():
        if type(module).__name__ == class_name:
            for sub, layer in module.named_modules():
                if isinstance(layer, (nn.Linear, nn.Conv2d)):
                    found.add(f"{path}.{sub}".replace(".", "_"))
    return found


def _kron_factor(dim: int, factor: int) -> int:
    """The smaller Kronecker factor of ``dim`` for a factor that divides it (LyCORIS' rule, by hand)."""
    return min(factor, dim // factor)


def test_module_algo_map_factors_reach_the_modules(make_config):
    preset = {
        "target_module": ["Attention", "FeedForward"],
        "module_algo_map": {"Attention": {"factor": 2}, "FeedForward": {"factor": 4}},
    }
    unet, modules = _adapted(make_config, {"algo": "lokr", "factor": 8, "apply_preset": preset})
    attention, feed_forward = _layers_inside(unet, "Attention"), _layers_inside(unet, "FeedForward")
    assert set(modules) == attention | feed_forward  # nothing else (no ResnetBlock conv, no proj_in)
    for name, module in modules.items():
        factor = 2 if name in attention else 4
        out_dim, in_dim = module.org_module[0].weight.shape
        assert type(module).__name__ == "LokrModule"
        assert tuple(module.lokr_w1.shape) == (_kron_factor(out_dim, factor), _kron_factor(in_dim, factor)), name
        # ... and not what the network-wide factor 8 would have made
        assert tuple(module.lokr_w1.shape) != (_kron_factor(out_dim, 8), _kron_factor(in_dim, 8)), name


def test_the_innermost_mapped_class_wins_and_maps_may_change_algo_and_rank(make_config):
    preset = {
        "target_module": ["BasicTransformerBlock"],
        "module_algo_map": {"FeedForward": {"algo": "locon", "dim": 2, "alpha": 1.0}},
    }
    unet, modules = _adapted(make_config, {"algo": "lokr", "factor": 4, "apply_preset": preset}, lora_alpha=8)
    feed_forward = _layers_inside(unet, "FeedForward")
    assert set(modules) == _layers_inside(unet, "BasicTransformerBlock")
    for name, module in modules.items():
        if name in feed_forward:  # the FeedForward's own settings: LoCon, rank 2, alpha 1
            assert type(module).__name__ == "LoConModule" and module.lora_down.weight.shape[0] == 2
            assert float(module.scale) == pytest.approx(1.0 / 2)
        else:  # the block's: the network's LoKr, factor 4 (alpha 8 over rank 4)
            out_dim, in_dim = module.org_module[0].weight.shape
            assert type(module).__name__ == "LokrModule"
            assert tuple(module.lokr_w1.shape) == (_kron_factor(out_dim, 4), _kron_factor(in_dim, 4))


def test_names_patterns_exclusions_conv_rank_and_multiplier(make_config):
    preset = {
        "target_name": ["conv_in", r"down_blocks\.0\.attentions\.0\.transformer_blocks\.0\.attn1\.to_"],
        "name_algo_map": {"time_embedding.linear_1": {"algo": "loha"}},
        "exclude_name": ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k"],
    }
    lycoris = {"algo": "locon", "apply_preset": preset, "conv_dim": 3, "conv_alpha": 3.0, "multiplier": 0.5}
    unet, modules = _adapted(make_config, lycoris)
    attn1 = "down_blocks_0_attentions_0_transformer_blocks_0_attn1_"
    assert set(modules) == {"conv_in", "time_embedding_linear_1", *(attn1 + t for t in ("to_q", "to_v", "to_out_0"))}
    assert modules["conv_in"].lora_down.weight.shape[0] == 3  # a 3x3 conv takes conv_dim
    assert modules[attn1 + "to_q"].lora_down.weight.shape[0] == 4  # a linear layer, lora_rank
    assert type(modules["time_embedding_linear_1"]).__name__ == "LohaModule"
    assert all(m.multiplier == 0.5 for m in modules.values())

    shell = {"target_name": ["down_blocks.0.attentions.0.transformer_blocks.0.attn?.to_q"], "use_fnmatch": True}
    _, modules = _adapted(make_config, {"algo": "locon", "apply_preset": shell})
    assert set(modules) == {attn1 + "to_q", attn1.replace("attn1", "attn2") + "to_q"}


def test_a_preset_naming_nothing_stops_before_training_with_what_the_model_has(make_config):
    preset = {"target_module": ["Attention", "Flux2Attention"], "target_name": ["single_blocks\\..*"]}
    with pytest.raises(ValueError) as info:
        _adapted(make_config, {"apply_preset": preset})
    message = str(info.value)
    assert "['Flux2Attention']" in message and "['single_blocks\\\\..*']" in message
    assert "'Attention'" not in message.split("Its attention")[0]  # Attention matched: not listed as missing
    for present in ("Attention", "BasicTransformerBlock", "FeedForward", "ResnetBlock2D"):
        assert f"'{present}'" in message.split("Its attention")[1]
    assert "'Linear'" not in message and "'Conv2d'" not in message

    # Through the trainer: it stops at model set-up, before a single step.
    from training_helpers import train

    raw = make_config(lora_type="lycoris", lycoris={"apply_preset": {"target_module": ["WanAttentionBlock"]}})
    with pytest.raises(ValueError, match="WanAttentionBlock"):
        train(raw)


def test_preset_shape_is_checked_with_the_config(make_config):
    def problems(lycoris, **overrides):
        with pytest.raises(ConfigError) as info:
            _config(make_config, lycoris, **overrides)
        return str(info.value)

    assert "names no layers" in problems({"apply_preset": {"exclude_name": ["conv_in"]}})
    assert "not a regular expression" in problems({"apply_preset": {"target_name": ["to_(q"]}})
    assert "lycoris.apply_preset.module_algo_map.Attention" in problems(
        {"apply_preset": {"target_module": ["Attention"], "module_algo_map": {"Attention": {"rank_dropout": 0.1}}}}
    )
    assert "bypass_mode true or base_model_precision 'no_change'" in problems(
        {"bypass_mode": False}, base_model_precision="int8_torchao"
    )


def test_merged_mode_computes_what_bypass_mode_computes(make_config):
    torch.manual_seed(0)
    outputs = []
    for bypass in (True, False):
        unet, modules = _adapted(make_config, {"algo": "lokr", "bypass_mode": bypass})
        for module in modules.values():  # a non-zero adapter, the same in both
            for name, p in sorted(module.named_parameters()):
                p.data = torch.sin(torch.arange(p.numel(), dtype=torch.float32) + len(name)).reshape(p.shape) * 0.1
        assert all(m.bypass_mode is bypass for m in modules.values())
        gen = torch.Generator().manual_seed(1)
        x, ctx = torch.randn(1, 4, 8, 8, generator=gen), torch.randn(1, 77, 32, generator=gen)
        with torch.no_grad():
            outputs.append(unet.eval()(x, torch.tensor([10]), ctx).sample)
            lycoris_network(unet).set_multiplier(0.0)
            base = unet(x, torch.tensor([10]), ctx).sample
        assert not torch.allclose(base, outputs[-1], atol=1e-3)  # the adapters do change the output
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)


def test_a_preset_run_trains_saves_and_reloads(make_config, tmp_path):
    from training_helpers import train

    from simpletuner.models.adapters.lycoris import load_lycoris

    preset = {"target_module": ["FeedForward"], "module_algo_map": {"FeedForward": {"factor": 4}}}
    raw = make_config(
        lora_type="lycoris", lycoris={"algo": "lokr", "apply_preset": preset}, max_train_steps=2, learning_rate=1e-2
    )
    trainer, result = train(raw)
    model = trainer.accelerator.unwrap_model(trainer.model)
    fresh = get_model_spec(validate_config(raw)).load_denoiser(torch.float32).requires_grad_(False).eval()
    loaded = load_lycoris(fresh, result.output_path)
    assert len(loaded.loras) == len(lycoris_network(model).loras) == len(_layers_inside(fresh, "FeedForward"))
    gen = torch.Generator().manual_seed(2)
    x, ctx = torch.randn(1, 4, 8, 8, generator=gen), torch.randn(1, 77, 32, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(
            fresh(x, torch.tensor([5]), ctx).sample, model.eval()(x, torch.tensor([5]), ctx).sample
        )
