"""kohya / ComfyUI exports of a trained LoRA (``simpletuner export``, ``output_formats``), checked by the reader
that matters: diffusers' own ``load_lora_weights`` (which detects the format and runs its converters) loads each
exported file into the family's pipeline, and every adapted layer's delta (``up @ down * alpha / rank``, what
fusing adds to the weight) equals the trained one, alpha != rank so the scale is checked too. Tiny zoo models,
random LoRA weights on the real adapter set-up; no training."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import load_file

from simpletuner.cli import main
from simpletuner.configuration import ConfigError, validate_config
from simpletuner.configuration.export_formats import export_format_of, export_problem
from simpletuner.models import get_model_spec
from simpletuner.models.adapters.export import (
    export_file,
    export_name,
    export_state_dict,
    read_diffusers_lora,
)
from simpletuner.models.adapters.lora_names import ExportError, LoraModule
from simpletuner.models.spec import FINAL_RECORD
from simpletuner.training.run_folder import write_run_config

RANK, ALPHA = 4, 6.0  # scale 1.5: not a power of two, so a lost or doubled alpha shows
FAMILY = {"wan22": "wan"}

SD_WIDE = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1", "conv2"]
SD_WIDE += ["time_emb_proj", "conv_shortcut", "downsamplers.0.conv", "conv_in", "conv_out", "linear_1", "linear_2"]
#: Flux's double blocks only: diffusers' kohya reader splits a single block's fused linear1 at Flux's own widths
#: (test_flux_kohya_single_blocks_at_flux_width checks those at 3072).
FLUX_DOUBLE = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v"]
FLUX_DOUBLE += ["attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
FLUX_DOUBLE += ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear"]
FLUX_DOUBLE += ["norm1_context.linear"]
QWEN_WIDE = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
QWEN_WIDE += ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2", "img_mod.1", "txt_mod.1"]
QWEN_WIDE += ["img_in", "txt_in", "proj_out", "norm_out.linear", "linear_1", "linear_2"]

#: family -> (targets, formats): every format the family has, on modules beyond the defaults where they map.
CASES = {
    "sd": (SD_WIDE, ("kohya", "comfyui")),
    "sdxl": (SD_WIDE, ("kohya", "comfyui")),
    "sd3": (None, ("comfyui",)),
    "flux": (FLUX_DOUBLE, ("kohya", "comfyui")),
    "wan": (None, ("kohya", "comfyui")),  # attention only: musubi's names get zero feed-forward LoRAs
    "qwen_image": (QWEN_WIDE, ("kohya", "comfyui")),
}


def _config(zoo, name, tmp_path, **overrides):
    family = FAMILY.get(name, name)
    raw = {
        "pretrained_model_name_or_path": str(zoo(name)),
        "model_family": family,
        "output_dir": str(tmp_path / "out"),
        "resolution": 64,
        "aspect_bucket_alignment": 16 if family in ("sd", "sdxl") else 32,
        "max_train_steps": 1,
        "lora_rank": RANK,
        "lora_alpha": ALPHA,
        "datasets": [{"id": "d", "type": "local", "instance_data_dir": str(tmp_path / "data")}],
        **overrides,
    }
    return raw, validate_config(raw, check_files=False)


def _adapted(spec, seed: int = 0):
    """The family's denoiser under the run's adapter set-up, every LoRA weight random (B too: not the identity)."""
    model = spec.prepare_denoiser(spec.load_denoiser(), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _deltas(model, adapter: str) -> dict[str, torch.Tensor]:
    """Each adapted layer's delta under ``adapter`` (peft's Linear / Conv layers define ``get_delta_weight``)."""
    layers: dict[str, Any] = {
        n: m for n, m in model.named_modules() if isinstance(m, LoraLayer) and adapter in m.lora_A
    }
    return {name: layer.get_delta_weight(adapter).detach() for name, layer in layers.items()}


def _assert_same(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor], what: str) -> None:
    """``got`` holds every trained layer's delta to 1e-6 (relative), and zero for any layer the run did not train."""
    assert set(truth) <= set(got), f"{what}: layers not loaded: {sorted(set(truth) - set(got))[:5]}"
    for name, delta in got.items():
        want = truth.get(name, torch.zeros_like(delta))
        err = float((delta.double() - want.double()).abs().max()) / max(float(want.abs().max()), 1e-12)
        assert err < 1e-6 or not want.any() and not delta.any(), f"{what}: {name} differs ({err:.2e})"


def _pipeline(folder):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(str(folder), use_safetensors=True)


@pytest.mark.parametrize("name", list(CASES))
def test_each_format_loads_back_through_diffusers_to_the_trained_weights(name, zoo, tmp_path):
    targets, formats = CASES[name]
    _, cfg = _config(zoo, name, tmp_path, **({"lora_target_modules": targets} if targets else {}))
    spec = get_model_spec(cfg)
    model = _adapted(spec)
    truth = _deltas(model, "default")
    source = spec.save_adapter(tmp_path / "lora", model)
    pipe = _pipeline(zoo(name))
    denoiser = getattr(pipe, spec.denoiser_name)
    pipe.load_lora_weights(str(source), adapter_name="diffusers")
    loaded = _deltas(denoiser, "diffusers")  # the reference; diffusers 0.42 reads only part of an sd file that
    _assert_same(loaded, {k: truth[k] for k in loaded}, "the diffusers file")  # adapts proj_in (its attention: no)
    for fmt in formats:
        target = export_file(
            source, tmp_path / "lora" / export_name(source.name, fmt), cfg.model_family, fmt, model.config
        )
        with safe_open(str(target), framework="pt") as handle:
            assert "lora_adapter_metadata" not in (handle.metadata() or {})  # its alpha would apply on top
        pipe.load_lora_weights(str(target), adapter_name=fmt)
        _assert_same(_deltas(denoiser, fmt), truth, f"{name} {fmt}")


def test_sdxl_kohya_names_are_sd_scripts_block_numbers_on_the_sdxl_layout():
    """sd-scripts numbers SDXL's blocks as the original (sgm) UNet: checked on SDXL's own layout (three blocks, two
    layers each, attention in the lower two), every Linear and Conv adapted, through the SDXL loader's reader."""
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from peft import LoraConfig

    torch.manual_seed(0)
    layout = dict(
        sample_size=8,
        layers_per_block=2,
        block_out_channels=(8, 16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 2),
        attention_head_dim=(2, 4, 8),
        cross_attention_dim=16,
        norm_num_groups=4,
        addition_embed_type="text_time",
        addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=28,
        use_linear_projection=True,
    )
    unet = UNet2DConditionModel(**layout)
    unet.add_adapter(
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=SD_WIDE + ["conv"], init_lora_weights="gaussian")
    )
    for name, p in unet.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn_like(p) * 0.1
    truth = _deltas(unet, "default")
    modules = {
        f"unet.{name}": LoraModule(m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach(), ALPHA)
        for name, m in unet.named_modules()
        if isinstance(m, LoraLayer)
    }
    state = export_state_dict(modules, "sdxl", "kohya", unet.config)
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in state
    assert "lora_unet_middle_block_1_proj_in.alpha" in state and "lora_unet_label_emb_0_0.lora_up.weight" in state
    fresh = UNet2DConditionModel(**layout)
    lora, alphas = StableDiffusionXLPipeline.lora_state_dict(dict(state), unet_config=fresh.config)
    StableDiffusionXLPipeline.load_lora_into_unet(lora, alphas, fresh, adapter_name="kohya")
    _assert_same(_deltas(fresh, "kohya"), truth, "sdxl kohya (sgm)")


def test_text_encoder_loras_get_kohyas_te_names(zoo, tmp_path):
    """SD and SDXL text-encoder LoRAs: ``lora_te_`` / ``lora_te1_`` / ``lora_te2_`` + the CLIP path under
    ``text_model`` (as kohya and ComfyUI name it; transformers 5 saves it without), read back by diffusers."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    pipe = _pipeline(zoo("sdxl"))
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj", "out_proj", "fc1", "fc2"])
    saved, truth = {}, {}
    for index, component in enumerate(("text_encoder", "text_encoder_2")):
        encoder = getattr(pipe, component)
        inject_adapter_in_model(config, encoder)
        gen = torch.Generator().manual_seed(index)
        for name, p in encoder.named_parameters():
            if "lora_B" in name:
                p.data = torch.randn(p.shape, generator=gen) * 0.1
        truth[component] = _deltas(encoder, "default")
        saved[f"{component}_lora_layers"] = convert_state_dict_to_diffusers(get_peft_model_state_dict(encoder))
        saved[f"{component}_lora_adapter_metadata"] = config.to_dict()
    pipe.save_lora_weights(str(tmp_path), **saved)
    source = tmp_path / "pytorch_lora_weights.safetensors"
    for fmt in ("kohya", "comfyui"):
        target = export_file(source, tmp_path / f"te.{fmt}.safetensors", "sdxl", fmt, {"layers_per_block": 1})
        assert any(k.startswith("lora_te2_text_model_encoder_layers_0_self_attn_q_proj.") for k in load_file(target))
        fresh = _pipeline(zoo("sdxl"))
        fresh.load_lora_weights(str(target), adapter_name=fmt)
        for component in truth:
            _assert_same(_deltas(getattr(fresh, component), fmt), truth[component], f"{component} {fmt}")
    module = LoraModule(torch.zeros(RANK, 8), torch.zeros(8, RANK), ALPHA)  # sd: one encoder, lora_te_
    assert "lora_te_text_model_encoder_layers_0_mlp_fc1.alpha" in export_state_dict(
        {"text_encoder.encoder.layers.0.mlp.fc1": module}, "sd", "kohya"
    )


def _random_modules(shapes: dict[str, tuple[int, int]], seed: int = 0) -> dict[str, LoraModule]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: LoraModule(torch.randn(RANK, cols, generator=gen), torch.randn(rows, RANK, generator=gen), ALPHA)
        for name, (rows, cols) in shapes.items()
    }


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a reader gets from a file: tensors of its own (diffusers' Wan reader scales them in place)."""
    return {key: value.clone() for key, value in state.items()}


def _products_match(read: dict[str, torch.Tensor], modules: dict[str, LoraModule], prefix: str = "") -> None:
    """Each module's ``up @ down * scale`` (float64, applied to random inputs) from what a diffusers reader returned
    (the scale folded in)."""
    gen = torch.Generator().manual_seed(1)
    for name, module in modules.items():
        down, up = read[f"{prefix}{name}.lora_A.weight"].double(), read[f"{prefix}{name}.lora_B.weight"].double()
        x = torch.randn(down.shape[1], 2, generator=gen, dtype=torch.float64)
        want = module.up.double() @ (module.down.double() @ x) * (module.alpha / module.rank)
        err = float((up @ (down @ x) - want).abs().max() / want.abs().max())
        assert err < 1e-6, (name, err)


def test_flux_kohya_single_blocks_at_flux_width():
    """sd-scripts fuses a single block's q, k, v and proj_mlp into ``linear1`` (rank 4 x, alpha 4 x); diffusers'
    reader splits it at Flux's widths (3072, 12288), so this is checked at those, on the state dict. Parts the run
    did not train (block 1's proj_mlp, block 0's k and v of the double block) are zero and read back as zero."""
    from diffusers import FluxPipeline

    width = 3072
    shapes = {f"transformer.single_transformer_blocks.0.attn.{p}": (width, width) for p in ("to_q", "to_k", "to_v")}
    shapes["transformer.single_transformer_blocks.0.proj_mlp"] = (4 * width, width)
    shapes |= {f"transformer.single_transformer_blocks.1.attn.{p}": (width, width) for p in ("to_q", "to_k", "to_v")}
    shapes["transformer.single_transformer_blocks.1.proj_out"] = (width, 5 * width)
    shapes["transformer.transformer_blocks.0.attn.to_q"] = (width, width)
    modules = _random_modules(shapes)
    state = export_state_dict(modules, "flux", "kohya")
    assert state["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape == (7 * width, 4 * RANK)
    assert float(state["lora_unet_single_blocks_0_linear1.alpha"]) == 4 * ALPHA
    assert float(state["lora_unet_double_blocks_0_img_attn_qkv.alpha"]) == 3 * ALPHA
    read = FluxPipeline.lora_state_dict(_copy(state))
    _products_match(read, modules)
    untrained = (
        "single_transformer_blocks.1.proj_mlp",
        "transformer_blocks.0.attn.to_k",
        "transformer_blocks.0.attn.to_v",
    )
    for name in untrained:
        assert not read[f"transformer.{name}.lora_B.weight"].any()


def test_wan_image_attention_gets_wans_image_names():
    """Wan 2.1 image-to-video's image keys (attn2.add_k_proj / add_v_proj) become cross_attn.k_img / v_img, which
    diffusers' Wan readers take as an I2V LoRA; checked on the state dict for both formats."""
    from diffusers import WanPipeline

    parts = ["attn1.to_q", "attn2.to_q", "attn2.add_k_proj", "attn2.add_v_proj", "ffn.net.0.proj"]
    shapes = {f"transformer.blocks.{i}.{p}": ((32 if "ffn" in p else 16), 16) for i in (0, 1) for p in parts}
    modules = _random_modules(shapes)
    comfy = export_state_dict(modules, "wan", "comfyui")
    assert "diffusion_model.blocks.1.cross_attn.k_img.lora_A.weight" in comfy
    _products_match(WanPipeline.lora_state_dict(_copy(comfy)), modules)
    kohya = export_state_dict(
        modules, "wan", "kohya", {"num_attention_heads": 2, "attention_head_dim": 8, "ffn_dim": 32}
    )
    assert (
        "lora_unet_blocks_0_cross_attn_v_img.alpha" in kohya
        and not kohya["lora_unet_blocks_0_ffn_2.lora_up.weight"].any()
    )
    _products_match(WanPipeline.lora_state_dict(_copy(kohya)), modules)


def test_alpha_round_trips_exactly_and_names_are_recognised():
    """``.alpha`` is float32 where float32 holds it (what kohya writes), float64 where not, so the reader's
    ``alpha / rank`` is the run's; file names carry the format."""
    gen = torch.Generator().manual_seed(0)
    for alpha, dtype in ((6.0, torch.float32), (0.1, torch.float64)):
        module = LoraModule(torch.randn(RANK, 8, generator=gen), torch.randn(8, RANK, generator=gen), alpha)
        state = export_state_dict({"transformer.transformer_blocks.0.attn.to_q": module}, "qwen_image", "kohya")
        written = state["lora_unet_transformer_blocks_0_attn_to_q.alpha"]
        assert written.dtype == dtype and written.item() == alpha
    assert export_name("pytorch_lora_weights_high_noise.safetensors", "kohya") == (
        "pytorch_lora_weights_high_noise.kohya.safetensors"
    )
    assert export_format_of("pytorch_lora_weights.comfyui.safetensors") == "comfyui"
    assert export_format_of("pytorch_lora_weights.safetensors") is None


def test_what_cannot_be_written_is_refused_by_name():
    module = LoraModule(torch.zeros(RANK, 8), torch.zeros(8, RANK), ALPHA)
    with pytest.raises(ExportError, match="sd3 has no kohya-named LoRA"):
        export_state_dict({"transformer.transformer_blocks.0.attn.to_q": module}, "sd3", "kohya")
    with pytest.raises(ExportError, match="x_embedder"):  # diffusers' kohya Flux reader drops it
        export_state_dict({"transformer.x_embedder": module}, "flux", "kohya")
    with pytest.raises(ExportError, match="condition_embedder.time_proj"):  # diffusers' Wan readers take no alpha
        export_state_dict({"transformer.condition_embedder.time_proj": module}, "wan", "comfyui")
    with pytest.raises(ExportError, match="UNet's config"):
        export_state_dict({"unet.conv_in": module}, "sdxl", "kohya")
    upsampler = {"unet.up_blocks.0.upsamplers.0.conv": module}  # an up block without attention: read elsewhere
    with pytest.raises(ExportError, match="upsamplers"):
        export_state_dict(upsampler, "sdxl", "kohya", {"layers_per_block": 1, "up_block_types": ["UpBlock2D"]})
    assert "LyCORIS" in export_problem("flux", "comfyui", "lora", "lycoris", False)
    assert "DoRA" in export_problem("flux", "comfyui", "lora", "standard", True)
    assert "full fine-tune" in export_problem("flux", "comfyui", "full", "standard", False)
    assert export_problem("sd3", "comfyui", "lora", "standard", False) is None


def test_output_formats_in_the_config(zoo, tmp_path):
    _, cfg = _config(zoo, "sd", tmp_path)
    assert cfg.output_formats == ["diffusers"]
    for formats, why in (
        (["diffusers", "kohya"], "sd3 has no kohya-named LoRA"),
        (["comfyui"], "must keep 'diffusers'"),
        (["diffusers", "comfyui", "comfyui"], "twice"),
    ):
        with pytest.raises(ConfigError, match=why):
            _config(zoo, "sd3", tmp_path, output_formats=formats)
    with pytest.raises(ConfigError, match="LyCORIS"):
        _config(zoo, "sd", tmp_path, output_formats=["diffusers", "kohya"], lora_type="lycoris")


def test_final_save_writes_the_formats_and_the_command_writes_the_same(zoo, tmp_path, capsys):
    """``output_formats``: the final save writes each format beside the diffusers file, in ``final_weights.json``
    (what the Hub upload sends); ``simpletuner export`` on the run folder writes the same tensors; a format the
    family lacks is one line and exit 2; a module no format maps is refused before training (check_exports)."""
    raw, cfg = _config(zoo, "sd", tmp_path, output_formats=["diffusers", "kohya", "comfyui"])
    spec = get_model_spec(cfg)
    model = _adapted(spec)
    out = tmp_path / "out"
    spec.check_exports(model)  # every module maps
    spec.save_final(out, model, full=False, step=3)
    write_run_config(out, raw)
    names = json.loads((out / FINAL_RECORD).read_text())["files"]
    assert names == [
        "pytorch_lora_weights.comfyui.safetensors",
        "pytorch_lora_weights.kohya.safetensors",
        "pytorch_lora_weights.safetensors",
    ]
    saved = load_file(out / "pytorch_lora_weights.kohya.safetensors")
    assert main(["export", str(out), "--format", "kohya", "--out", str(tmp_path / "again.safetensors")]) == 0
    again = load_file(tmp_path / "again.safetensors")
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    assert read_diffusers_lora(out / "pytorch_lora_weights.safetensors").keys()  # the source is untouched
    assert main(["export", str(out), "--format", "comfyui", "--checkpoint", "7"]) == 2
    assert "checkpoint-7 is not a complete checkpoint" in capsys.readouterr().err

    sd3_raw, _ = _config(zoo, "sd3", tmp_path)
    write_run_config(tmp_path / "sd3_run", sd3_raw)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "sd3_run"), "--format", "kohya"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: sd3 has no kohya-named LoRA") and "\n" not in err

    _, flux_cfg = _config(
        zoo, "flux", tmp_path, output_formats=["diffusers", "kohya"], lora_target_modules=["x_embedder"]
    )
    flux = get_model_spec(flux_cfg)
    with pytest.raises(ValueError, match="output_formats 'kohya'.*x_embedder"):
        flux.check_exports(flux.prepare_denoiser(flux.load_denoiser(), torch.float32))


def test_wan22_experts_each_get_their_file(zoo, tmp_path):
    """Wan 2.2: one export per expert file, loaded into transformer / transformer_2 as the diffusers files are;
    ``simpletuner export`` writes one per expert too (``--out`` names one file: refused)."""
    from diffusers import WanPipeline

    raw, cfg = _config(zoo, "wan22", tmp_path, output_formats=["diffusers", "comfyui"])
    spec = get_model_spec(cfg)
    model = _adapted(spec)
    out = tmp_path / "out"
    spec.save_final(out, model, full=False, step=1)
    write_run_config(out, raw)
    # the command: a file per expert; musubi's names need the feed-forward sizes, read from the model's config
    assert main(["export", str(out), "--format", "kohya"]) == 0
    for stage in ("high", "low"):
        kohya = load_file(out / f"pytorch_lora_weights_{stage}_noise.kohya.safetensors")
        assert not kohya["lora_unet_blocks_0_ffn_0.lora_up.weight"].any()
    assert main(["export", str(out), "--format", "kohya", "--out", str(tmp_path / "one.safetensors")]) == 2
    pipe = WanPipeline.from_pretrained(str(zoo("wan22")), use_safetensors=True)
    for stage, component in (("high", "transformer"), ("low", "transformer_2")):
        name = f"pytorch_lora_weights_{stage}_noise.comfyui.safetensors"
        pipe.load_lora_weights(str(out), weight_name=name, adapter_name=stage, load_into_transformer_2=stage == "low")
        _assert_same(_deltas(getattr(pipe, component), stage), _deltas(model.expert(stage), "default"), stage)


def test_simpletuners_lora_format(tmp_path):
    """SimpleTuner's ``lora_format: comfyui`` (any case; lora_format.py:17-28) asks for the ComfyUI file: here it is
    written beside the diffusers one. Any other value, and a LyCORIS, full or DoRA run, keep diffusers' format."""
    from simpletuner.configuration.simpletuner import translate as dialect

    base = {"--model_family": "flux", "--pretrained_model_name_or_path": str(tmp_path), "--model_type": "lora"}
    native, report = dialect.translate({**base, "--lora_format": " ComfyUI"}, cwd=tmp_path)
    assert native["output_formats"] == ["diffusers", "comfyui"]
    assert any(line.startswith("`lora_format`") for line in report.approximated)
    for other in ({"--lora_format": "diffusers"}, {"--lora_format": "comfyui", "--lora_type": "lycoris"}):
        native, _ = dialect.translate({**base, **other}, cwd=tmp_path)
        assert "output_formats" not in native
    native, _ = dialect.translate({**base, "--lora_format": "comfyui", "--use_dora": "true"}, cwd=tmp_path)
    assert "output_formats" not in native
