"""A LoRA's modules under the key names kohya-ss' trainers and ComfyUI use, family by family: each (family, format)
has a writer in :data:`WRITERS` that renames ``<component>.<module path>`` -> :class:`LoraModule` into the tensors of
that format's file, with the alpha rule of :mod:`simpletuner.models.adapters.export`.

Each naming is the one a diffusers reader maps back to the same module (the test of every writer,
tests/test_export.py); a module it would map elsewhere is refused by name, and a module it requires that the run did
not train is written as a zero LoRA. The readers and the tools behind each naming: documentation/MODEL_FAMILIES.md,
"Exporting the adapter".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch


class ExportError(ValueError):
    """The adapter cannot be written in the format asked for; the message says which modules or why."""


@dataclass(frozen=True)
class LoraModule:
    """One adapted layer: ``down`` [rank, in, ...] and ``up`` [out, rank, ...]; it adds ``up @ down * alpha / rank``."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


#: ``"<component>.<module path>"`` (``unet.down_blocks.0...to_q``, ``transformer.blocks.0.attn1.to_q``) -> its LoRA.
Modules = dict[str, LoraModule]


def _alpha_tensor(alpha: float) -> torch.Tensor:
    """A module's ``.alpha``: float32 as kohya writes it, float64 where float32 does not hold ``alpha`` exactly."""
    single = torch.tensor(alpha, dtype=torch.float32)
    return single if float(single) == alpha else torch.tensor(alpha, dtype=torch.float64)


def _folded(module: LoraModule) -> tuple[torch.Tensor, torch.Tensor]:
    """``down`` and ``up`` with the scale ``alpha / rank`` multiplied in, split between them by powers of two as
    diffusers' own converters split it."""
    scale_down, scale_up = module.alpha / module.rank, 1.0
    while scale_down * 2 < scale_up:
        scale_down *= 2
        scale_up /= 2
    return module.down * scale_down, module.up * scale_up


def _strip(modules: Modules, component: str) -> dict[str, LoraModule]:
    """The modules of ``component`` by their path inside it; any other component is refused."""
    others = sorted({name.split(".", 1)[0] for name in modules} - {component})
    if others:
        raise ExportError(f"the adapter has {', '.join(others)} modules; this format holds {component} modules only")
    return {name.split(".", 1)[1]: module for name, module in modules.items()}


def _refuse_unmapped(unmapped: list[str], fmt: str, family: str, why: str) -> None:
    if unmapped:
        shown = ", ".join(unmapped[:6]) + (f" and {len(unmapped) - 6} more" if len(unmapped) > 6 else "")
        raise ExportError(f"{fmt} ({family}): {why}: {shown}")


# --- kohya names with lora_down / lora_up / alpha ------------------------------------------------------------


def _kohya_entries(name: str, module: LoraModule) -> dict[str, torch.Tensor]:
    return {
        f"{name}.lora_down.weight": module.down,
        f"{name}.lora_up.weight": module.up,
        f"{name}.alpha": _alpha_tensor(module.alpha),
    }


def _peft_entries(name: str, module: LoraModule) -> dict[str, torch.Tensor]:
    return {
        f"{name}.lora_A.weight": module.down,
        f"{name}.lora_B.weight": module.up,
        f"{name}.alpha": _alpha_tensor(module.alpha),
    }


#: The kohya prefix of each UNet-family component (sd-scripts; sdxl numbers its two text encoders).
_KOHYA_COMPONENTS = {
    "sd": {"unet": "lora_unet", "text_encoder": "lora_te"},
    "sdxl": {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"},
}


def _unet_kohya(
    modules: Modules, family: str, rename: Callable[[str], str | None] = lambda path: path
) -> dict[str, torch.Tensor]:
    """sd / sdxl: ``lora_unet_<path with _>`` (``rename`` maps the UNet path first: sdxl's kohya names), the text
    encoders ``lora_te*_<path with _>``; the names ComfyUI maps for these families too."""
    out: dict[str, torch.Tensor] = {}
    unmapped = []
    for name, module in modules.items():
        component, path = name.split(".", 1)
        prefix = _KOHYA_COMPONENTS[family].get(component)
        mapped = rename(path) if component == "unet" else _clip_path(path)
        if prefix is None or mapped is None:
            unmapped.append(name)
            continue
        out.update(_kohya_entries(f"{prefix}_{mapped.replace('.', '_')}", module))
    _refuse_unmapped(unmapped, "kohya", family, "no kohya name that diffusers maps back to these modules")
    return out


def _clip_path(path: str) -> str:
    """A CLIP text encoder module path as kohya names it, under ``text_model.`` (transformers 5 saves it without)."""
    return path if path.startswith(("text_model.", "text_projection")) else f"text_model.{path}"


# --- sdxl: sd-scripts' own (sgm) UNet names -------------------------------------------------------------------

_RESNET_SGM = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_TOP_SGM = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
#: sdxl's ComfyUI file names these by their sgm names: diffusers' reader maps ``add_embedding_linear_1`` elsewhere.
_SDXL_LABEL_EMB = {name: _TOP_SGM[name] for name in ("add_embedding.linear_1", "add_embedding.linear_2")}
_BLOCK = re.compile(r"^(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)$")
_MID = re.compile(r"^mid_block\.(resnets|attentions)\.(\d+)\.(.+)$")


def sgm_unet_path(path: str, unet_config: Mapping[str, Any]) -> str | None:
    """A diffusers SDXL UNet module path under sd-scripts' (sgm) SDXL UNet names (``down_blocks.1.attentions.0.``
    -> ``input_blocks.4.1.``, resnet ``conv1`` -> ``in_layers.2``, ...), as ``_maybe_map_sgm_blocks_to_diffusers``
    maps them back; None where that reader would map it elsewhere (an upsampler of a block without attention)."""
    per_block = unet_config["layers_per_block"]
    if not isinstance(per_block, int):
        return None  # a per-block list: sgm numbering assumes one count
    if path in _TOP_SGM:
        return _TOP_SGM[path]
    if (mid := _MID.match(path)) is not None:
        kind, index, rest = mid.groups()
        slot = 1 if kind == "attentions" else 2 * int(index)
        return f"middle_block.{slot}.{_resnet_sgm(rest) if kind == 'resnets' else rest}"
    match = _BLOCK.match(path)
    if match is None:
        return None
    blocks, block, kind, index, rest = match.groups()
    b, j = int(block), int(index)
    if blocks == "down_blocks":
        if kind == "downsamplers":
            return f"input_blocks.{(b + 1) * (per_block + 1)}.0.{'op' if rest == 'conv' else rest}"
        number, inner = 1 + b * (per_block + 1) + j, 0 if kind == "resnets" else 1
        return f"input_blocks.{number}.{inner}.{_resnet_sgm(rest) if kind == 'resnets' else rest}"
    if kind == "upsamplers":
        has_attention = "CrossAttn" in unet_config["up_block_types"][b]
        return f"output_blocks.{b * (per_block + 1) + per_block}.2.{rest}" if has_attention else None
    number, inner = b * (per_block + 1) + j, 0 if kind == "resnets" else 1
    return f"output_blocks.{number}.{inner}.{_resnet_sgm(rest) if kind == 'resnets' else rest}"


def _resnet_sgm(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return _RESNET_SGM.get(head, head) + (f".{tail}" if tail else "")


# --- flux: sd-scripts' BFL names, q/k/v fused ----------------------------------------------------------------

_FLUX_DOUBLE = {
    "attn.to_out.0": "img_attn_proj",
    "ff.net.0.proj": "img_mlp_0",
    "ff.net.2": "img_mlp_2",
    "norm1.linear": "img_mod_lin",
    "attn.to_add_out": "txt_attn_proj",
    "ff_context.net.0.proj": "txt_mlp_0",
    "ff_context.net.2": "txt_mlp_2",
    "norm1_context.linear": "txt_mod_lin",
}
_FLUX_DOUBLE_FUSED = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_FLUX_SINGLE = {"proj_out": "linear2", "norm.linear": "modulation_lin"}
_FLUX_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
#: Flux's single-block MLP width per model width (FluxSingleTransformerBlock's mlp_ratio, fixed by the model).
_FLUX_MLP_RATIO = 4
_FLUX_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def _flux_kohya(modules: Modules) -> dict[str, torch.Tensor]:
    """flux: ``lora_unet_double_blocks_<i>_img_attn_qkv`` ... (sd-scripts), what ComfyUI and diffusers'
    ``_convert_kohya_flux_lora_to_diffusers`` read. Fused parts become one LoRA of rank ``n * rank`` (down rows
    stacked, up block-diagonal), a part the run did not train a zero block."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, tuple[str, ...]], dict[str, LoraModule]] = {}
    unmapped = []
    for path, module in _strip(modules, "transformer").items():
        match = _FLUX_BLOCK.match(path)
        if match is None:
            unmapped.append(path)
            continue
        blocks, index, rest = match.groups()
        kind = "double_blocks" if blocks == "transformer_blocks" else "single_blocks"
        plain, fused = (
            (_FLUX_DOUBLE, _FLUX_DOUBLE_FUSED) if kind == "double_blocks" else (_FLUX_SINGLE, _FLUX_SINGLE_FUSED)
        )
        if rest in plain:
            out.update(_kohya_entries(f"lora_unet_{kind}_{index}_{plain[rest]}", module))
            continue
        target = next((item for item in fused.items() if rest in item[1]), None)
        if target is None:
            unmapped.append(path)
            continue
        groups.setdefault((f"lora_unet_{kind}_{index}_{target[0]}", target[1]), {})[rest] = module
    _refuse_unmapped(
        unmapped,
        "kohya",
        "flux",
        "diffusers' kohya Flux reader drops modules outside the double / single blocks (use --format comfyui)",
    )
    for (name, parts), trained in groups.items():
        out.update(_kohya_entries(name, _fuse(name, parts, trained)))
    return out


def _fuse(key: str, names: tuple[str, ...], parts: Mapping[str, LoraModule]) -> LoraModule:
    first = next(iter(parts.values()))
    if any(m.rank != first.rank or m.alpha != first.alpha for m in parts.values()):
        raise ExportError(f"kohya (flux): the parts of {key} ({', '.join(parts)}) differ in rank or alpha")
    width = first.down.shape[1]
    downs, ups = [], []
    for name in names:
        module = parts.get(name)
        if module is None:  # an untrained part: zero, so the fused LoRA changes only what was trained
            rows = width * _FLUX_MLP_RATIO if name == "proj_mlp" else width
            module = LoraModule(first.down.new_zeros(first.down.shape), first.up.new_zeros((rows, first.rank)), 0.0)
        downs.append(module.down)
        ups.append(module.up)
    return LoraModule(torch.cat(downs), torch.block_diag(*ups), first.alpha * len(names))


# --- wan: Wan's own module names (ComfyUI, diffusers' non-diffusers reader) and musubi-tuner's ----------------

_WAN_ATTENTION = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "add_k_proj": "k_img", "add_v_proj": "v_img"}
_WAN_BLOCK = re.compile(r"^blocks\.(\d+)\.(attn1|attn2|ffn)\.(.+)$")
_WAN_FFN = {"net.0.proj": "ffn.0", "net.2": "ffn.2"}


def wan_native_path(path: str) -> str | None:
    """A diffusers Wan transformer module path under Wan's own names (``blocks.0.attn1.to_q`` ->
    ``blocks.0.self_attn.q``); None outside the blocks' attention and feed-forward (diffusers' Wan readers take
    no alpha there)."""
    match = _WAN_BLOCK.match(path)
    if match is None:
        return None
    index, part, rest = match.groups()
    if part == "ffn":
        return f"blocks.{index}.{_WAN_FFN[rest]}" if rest in _WAN_FFN else None
    if rest not in _WAN_ATTENTION or (part == "attn1" and rest.startswith("add_")):
        return None
    return f"blocks.{index}.{'self_attn' if part == 'attn1' else 'cross_attn'}.{_WAN_ATTENTION[rest]}"


def _wan_comfyui(modules: Modules) -> dict[str, torch.Tensor]:
    """wan: ``diffusion_model.blocks.<i>.self_attn.q.lora_A.weight`` + ``.alpha``: ComfyUI's generic names for its
    (Wan-native) model, read by diffusers' ``_convert_non_diffusers_wan_lora_to_diffusers``."""
    out: dict[str, torch.Tensor] = {}
    unmapped = []
    for path, module in _strip(modules, "transformer").items():
        native = wan_native_path(path)
        if native is None:
            unmapped.append(path)
        else:
            out.update(_peft_entries(f"diffusion_model.{native}", module))
    _refuse_unmapped(unmapped, "comfyui", "wan", "outside the blocks' attention and feed-forward, not exported")
    return out


#: What musubi's Wan reader in diffusers wants in every block (the image keys too, once any block has them).
_WAN_PARTS = tuple(f"attn{n}.{p}" for n in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0"))
_WAN_PARTS += ("ffn.net.0.proj", "ffn.net.2")
_WAN_IMAGE_PARTS = ("attn2.add_k_proj", "attn2.add_v_proj")


def _wan_kohya(modules: Modules, denoiser_config: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """wan: musubi-tuner's ``lora_unet_blocks_<i>_self_attn_q`` + ``.alpha``. diffusers'
    ``_convert_musubi_wan_lora_to_diffusers`` wants q/k/v/o of both attentions and both feed-forward layers in
    every block: those the run did not train are written as zero LoRAs (sized as the same layer of a trained
    block, else from the model's config)."""
    stripped = _strip(modules, "transformer")
    unmapped = [path for path in stripped if wan_native_path(path) is None]
    _refuse_unmapped(unmapped, "kohya", "wan", "outside the blocks' attention and feed-forward, not exported")
    first = next(iter(stripped.values()))
    if any(m.rank != first.rank for m in stripped.values()):
        raise ExportError("kohya (wan): the adapter's modules differ in rank")
    by_part = {path.split(".", 2)[2]: module for path, module in sorted(stripped.items())}
    config = denoiser_config or {}
    width = int(config.get("num_attention_heads", 0)) * int(config.get("attention_head_dim", 0))
    sizes = {"ffn.net.0.proj": (config.get("ffn_dim"), width), "ffn.net.2": (width, config.get("ffn_dim"))}
    parts = _WAN_PARTS + (_WAN_IMAGE_PARTS if any(p in by_part for p in _WAN_IMAGE_PARTS) else ())
    out: dict[str, torch.Tensor] = {}
    for index in range(1 + max(int(path.split(".")[1]) for path in stripped)):
        for part in parts:
            path = f"blocks.{index}.{part}"
            module = stripped.get(path)
            if module is None:  # untrained here: zero, shaped as the layer is
                peer = by_part.get(part)
                rows, cols = (peer.up.shape[0], peer.down.shape[1]) if peer else sizes.get(part, (width, width))
                if not rows or not cols:
                    raise ExportError(
                        "kohya (wan): musubi's names need every block's attention and feed-forward, and the model's "
                        "config (num_attention_heads, attention_head_dim, ffn_dim) to size the untrained ones was not "
                        "available"
                    )
                module = LoraModule(
                    first.down.new_zeros((first.rank, cols)), first.up.new_zeros((rows, first.rank)), first.alpha
                )
            native = wan_native_path(path)
            assert native is not None  # every part is one of Wan's block layers
            out.update(_kohya_entries(f"lora_unet_{native.replace('.', '_')}", module))
    return out


# --- qwen_image: its names are diffusers' ----------------------------------------------------------------------


def _qwen_comfyui(modules: Modules) -> dict[str, torch.Tensor]:
    """qwen_image: ``diffusion_model.<path>.lora_A.weight`` + ``.alpha`` (ComfyUI's Qwen-Image names are diffusers')."""
    out: dict[str, torch.Tensor] = {}
    for path, module in _strip(modules, "transformer").items():
        out.update(_peft_entries(f"diffusion_model.{path}", module))
    return out


def _qwen_kohya(modules: Modules) -> dict[str, torch.Tensor]:
    """qwen_image: musubi-tuner's ``lora_unet_transformer_blocks_<i>_attn_to_q`` + ``.alpha``."""
    out: dict[str, torch.Tensor] = {}
    for path, module in _strip(modules, "transformer").items():
        out.update(_kohya_entries(f"lora_unet_{path.replace('.', '_')}", module))
    return out


# --- flux / sd3: ComfyUI's diffusers names ---------------------------------------------------------------------


def _flux_comfyui(modules: Modules) -> dict[str, torch.Tensor]:
    """flux: ``transformer.<path>.lora_A.weight`` + ``transformer.<path>.alpha`` (SimpleTuner's ComfyUI file; ComfyUI
    maps diffusers' Flux names, and diffusers reads the alpha keys)."""
    out: dict[str, torch.Tensor] = {}
    for path, module in _strip(modules, "transformer").items():
        out.update(_peft_entries(f"transformer.{path}", module))
    return out


def _sd3_comfyui(modules: Modules) -> dict[str, torch.Tensor]:
    """sd3: ``transformer.<path>.lora_A.weight`` with the scale folded in and no alpha key (ComfyUI maps diffusers'
    SD3 names and takes no alpha as scale 1; diffusers refuses an alpha key for sd3 and, without metadata, also
    loads at scale 1)."""
    out: dict[str, torch.Tensor] = {}
    for path, module in _strip(modules, "transformer").items():
        down, up = _folded(module)
        out.update({f"transformer.{path}.lora_A.weight": down, f"transformer.{path}.lora_B.weight": up})
    return out


#: (family, format) pairs whose names need the denoiser's config (sdxl: block numbering; wan: untrained layers' sizes).
NEEDS_DENOISER_CONFIG = frozenset({("sdxl", "kohya"), ("wan", "kohya")})

Writer = Callable[[Modules, Mapping[str, Any]], dict[str, torch.Tensor]]


def _sdxl_kohya(modules: Modules, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    if not config:
        raise ExportError("kohya (sdxl): sd-scripts' block numbers need the UNet's config, which was not available")
    return _unet_kohya(modules, "sdxl", lambda path: sgm_unet_path(path, config))


#: (family, format) -> its writer, given the modules and the denoiser's config ({} when unknown).
WRITERS: dict[tuple[str, str], Writer] = {
    ("sd", "kohya"): lambda modules, _: _unet_kohya(modules, "sd"),
    ("sd", "comfyui"): lambda modules, _: _unet_kohya(modules, "sd"),
    ("sdxl", "kohya"): _sdxl_kohya,
    # diffusers' reader strips the index of add_embedding.linear_N: its sgm name instead
    ("sdxl", "comfyui"): lambda modules, _: _unet_kohya(modules, "sdxl", lambda path: _SDXL_LABEL_EMB.get(path, path)),
    ("sd3", "comfyui"): lambda modules, _: _sd3_comfyui(modules),
    ("flux", "comfyui"): lambda modules, _: _flux_comfyui(modules),
    ("flux", "kohya"): lambda modules, _: _flux_kohya(modules),
    ("wan", "comfyui"): lambda modules, _: _wan_comfyui(modules),
    ("wan", "kohya"): _wan_kohya,
    ("qwen_image", "comfyui"): lambda modules, _: _qwen_comfyui(modules),
    ("qwen_image", "kohya"): lambda modules, _: _qwen_kohya(modules),
}
