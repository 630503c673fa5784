"""Quantised frozen base weights (``base_model_precision``): 8-, 4- or 2-bit Linear weights under an fp32 adapter.

Weight-only, through optimum-quanto (``qint8``, ``qfloat8``, ``qint4``, ``qint2``: each frozen ``nn.Linear``
becomes a ``QLinear``; 4 and 2 bits keep a scale and shift per group of up to 128 weights) or torchao
(``int8_torchao``, ``fp8_torchao``: ``quantize_`` swaps the weight, the module stays an ``nn.Linear``). Only
Linear layers outside the model's ``_keep_in_fp32_modules`` are quantised, before the adapter is added: peft's
LoRA wraps both kinds and LyCORIS runs them in bypass mode.
See documentation/MEMORY.md, "LyCORIS and quantised base weights".
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from simpletuner.models.library_probes import torchao_in_use

logger = logging.getLogger(__name__)

#: base_model_precision -> (library, its extra)
QUANTO_KINDS = ("qint8", "qfloat8", "qint4", "qint2")
TORCHAO_KINDS = ("int8_torchao", "fp8_torchao")
#: Bits per weight of optimum-quanto's packed (below 8 bits) kinds.
_QBITS = {"qint4": 4, "qint2": 2}
#: Bytes per output row besides the 8-bit data: the scale (and torchao int8's zero point).
_ROW_BYTES = {"qint8": None, "qfloat8": None, "int8_torchao": 4 + 1, "fp8_torchao": 4}


def is_quantized_precision(precision: str) -> bool:
    """Whether ``base_model_precision`` asks for quantised base weights (anything but ``no_change``)."""
    if precision == "no_change":
        return False
    if precision not in QUANTO_KINDS + TORCHAO_KINDS:
        raise ValueError(
            f"base_model_precision {precision!r} is not one of no_change, {', '.join(QUANTO_KINDS + TORCHAO_KINDS)}"
        )
    return True


def check_adapter_support(precision: str, lora_type: str, use_dora: bool) -> None:
    """Refuse, before anything is quantised, a base precision the configured adapter cannot train on.

    Raises:
        ValueError: peft's DoRA on an optimum-quanto base (DoRA reads the base weight's norm and
            cannot dequantise quanto weights), with what to use instead.
    """
    if is_quantized_precision(precision) and precision in QUANTO_KINDS and lora_type == "standard" and use_dora:
        raise ValueError(
            f"lora_use_dora with base_model_precision {precision!r}: peft's DoRA cannot read optimum-quanto "
            "weights; use base_model_precision 'int8_torchao' or 'fp8_torchao' with DoRA, or set lora_use_dora false"
        )


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The frozen ``nn.Linear`` layers quantisation replaces, by module name.

    Layers that train (an adapter's own Linear layers), that are quantised already, or that sit
    under one of the model's ``_keep_in_fp32_modules`` (precision-sensitive by the model's own
    account) are left out.
    """
    keep: set[str] = set()
    for module in model.modules():
        keep.update(getattr(module, "_keep_in_fp32_modules", None) or [])
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or keep.intersection(name.split(".")):
            continue
        weight = module.weight
        if weight is None or weight.requires_grad or not _is_plain(weight) or not weight.is_floating_point():
            continue
        found[name] = module
    return found


def _is_plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, nn.Parameter)


def quantize_base(model: nn.Module, precision: str, device: torch.device | None = None) -> int:
    """Quantise the frozen base's Linear weights of ``model`` in place; returns how many layers.

    Call it after freezing and casting the base, before adding an adapter. ``device``: move each
    layer there before quantising it (e.g. the GPU, so quantising a large model is fast and its
    full-precision weights never all sit on the GPU at once); None leaves layers where they are.
    A model on the ``meta`` device (the memory estimator) is left unquantised: the libraries need
    real weights, and the estimator counts the 8-bit bytes itself (``quantized_size``).

    Raises:
        ValueError: an unknown ``precision``, or its library is not installed (with the pip command).
    """
    if not is_quantized_precision(precision):
        return 0
    layers = quantizable_linears(model)
    if any(layer.weight.is_meta for layer in layers.values()):
        return 0
    if precision in QUANTO_KINDS:
        _quantize_quanto(model, layers, precision, device)
    else:
        _quantize_torchao(layers, precision, device)
    logger.info("base_model_precision %s: quantised %d Linear layers", precision, len(layers))
    return len(layers)


def _quantize_quanto(model: nn.Module, layers: dict[str, nn.Linear], precision: str, device) -> None:
    try:
        from optimum.quanto import qfloat8, qint2, qint4, qint8
        from optimum.quanto.nn import quantize_module
    except ImportError as exc:
        raise ValueError(
            f'base_model_precision {precision!r} needs optimum-quanto: pip install -e ".[quanto]" in the simpletuner '
            "checkout (or pip install optimum-quanto) "
            f"(or use base_model_precision 'no_change')"
        ) from exc
    weights = {"qint8": qint8, "qfloat8": qfloat8, "qint4": qint4, "qint2": qint2}[precision]
    for name, layer in layers.items():
        if device is not None:
            layer.to(device)
        qlayer = quantize_module(layer, weights=weights)
        if _int4_cpu_packing_fails(qlayer):
            _freeze_unpacked(qlayer)
        else:
            qlayer.freeze()  # float weight -> WeightQBytesTensor (8 bits) / WeightQBitsTensor, one layer at a time
        qlayer.requires_grad_(False)  # freeze() makes a new Parameter, which would train
        if precision == "qint8":
            qlayer.register_forward_pre_hook(_safe_int8_cpu_input)
        elif precision in _QBITS:
            qlayer.register_forward_pre_hook(_qbits_input)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, qlayer)


#: in_features the CPU int8 kernel handles: a multiple of this (measured on torch 2.13, see below).
_INT8_CPU_K_MULTIPLE = 16


def _safe_int8_cpu_input(module: nn.Linear, args: tuple):
    """Keep a qint8 layer on CPU off the crashing paths of torch's int8 kernel.

    For a bf16 input on CPU optimum-quanto multiplies with ``torch._weight_int8pack_mm``, which in
    torch 2.13 crashes the process (SIGSEGV) when in_features is not a multiple of 16 and there is
    more than one row (with one row it returns wrong values), and raises for an input that is not
    contiguous in its last dimension (SDXL's linear projections). Measured over in_features 4..128,
    rows 1..64: every multiple of 16 is right, every other value fails. So: such a layer gets its
    input in fp32, for which quanto takes its dequantising matmul (the same bf16 product, computed
    by ``torch.matmul``); any other gets a contiguous input. CUDA inputs are left alone (quanto's
    CUDA path does not use that kernel).
    """
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype != torch.bfloat16:
        return None
    if module.in_features % _INT8_CPU_K_MULTIPLE:
        return (x.float(), *args[1:])
    return None if x.is_contiguous() else (x.contiguous(), *args[1:])


#: torch's CPU int4 packing (``_convert_weight_to_int4pack_for_cpu``) needs out_features a multiple of this.
_INT4_CPU_N_MULTIPLE = 16


def _int4_cpu_packing_fails(qlayer: nn.Module) -> bool:
    """Whether quanto would pack this qint4 layer for torch's CPU int4 kernel (its rule: bf16 weights on CPU,
    groups of 128; ``WeightQBitsTensor.create``) where that packing raises: out_features not a multiple of 16.
    Real models' layers are; the tiny test models' need not be."""
    weight = qlayer.weight
    return (
        getattr(getattr(qlayer, "weight_qtype", None), "bits", 8) == 4
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and getattr(qlayer, "weight_group_size", None) == 128
        and weight.shape[0] % _INT4_CPU_N_MULTIPLE != 0
    )


def _freeze_unpacked(qlayer) -> None:
    """``qlayer.freeze()``, but keeping quanto's portable int4 tensor (a dequantising matmul) instead of packing it
    for the CPU kernel: the same quantised values, scale and shift."""
    from optimum.quanto import quantize_weight

    scale, shift = qlayer.optimizer(
        qlayer.weight, qtype=qlayer.weight_qtype, axis=0, group_size=qlayer.weight_group_size
    )
    qweight = quantize_weight(
        qlayer.weight,
        qtype=qlayer.weight_qtype,
        axis=0,
        scale=scale,
        shift=shift,
        group_size=qlayer.weight_group_size,
        optimized=False,
    )
    qlayer.weight = nn.Parameter(qweight, requires_grad=False)


def _qbits_input(module: nn.Module, args: tuple):
    """Give a 4- / 2-bit layer its input in the weight's dtype, contiguous.

    quanto's int4 kernels (torch's ``_weight_int4pack_mm`` on CPU and CUDA, for bf16 weights) run outside autocast
    and refuse an fp32 input (what a LayerNorm returns under bf16 autocast) and a non-contiguous one; an autocast
    ``nn.Linear`` would compute in the weight's dtype too. Measured on torch 2.13 CPU.
    """
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    dtype = module.weight.dtype
    assert isinstance(dtype, torch.dtype)  # a QLinear's weight: a quantised tensor in its float dtype
    if x.dtype == dtype and x.is_contiguous():
        return None
    return (x.to(dtype).contiguous(), *args[1:])


def _quantize_torchao(layers: dict[str, nn.Linear], precision: str, device) -> None:
    try:
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as exc:
        raise ValueError(
            f'base_model_precision {precision!r} needs torchao: pip install -e ".[torchao]" in the simpletuner '
            "checkout (or pip install torchao) "
            f"(or use base_model_precision 'no_change')"
        ) from exc
    torchao_in_use()  # peft's torchao-aware LoRA layers for these weights
    config = Int8WeightOnlyConfig() if precision == "int8_torchao" else Float8WeightOnlyConfig()
    for layer in layers.values():
        if device is not None:
            layer.to(device)
        quantize_(layer, config)  # the layer itself matches torchao's Linear filter
        layer.requires_grad_(False)
        # torchao's weights handle F.linear before autocast sees it: an int8 layer would return
        # fp32 for an fp32 input where an unquantised one under bf16 autocast returns bf16 (and
        # the next GroupNorm then meets mixed dtypes). Cast the input as autocast would.
        layer.register_forward_pre_hook(_autocast_input)


def _autocast_input(module: nn.Module, args: tuple):
    x = args[0] if args else None
    if torch.is_tensor(x) and x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        if x.dtype != dtype:
            return (x.to(dtype), *args[1:])
    return None


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor's storage takes, looking inside quantised tensor subclasses (8-bit data + scales)."""
    if not _is_plain(tensor) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, n)) for n in names)
    return tensor.nbytes


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of every parameter of ``model``, quantised ones at their real (8-bit plus scale) size."""
    return sum(tensor_bytes(p) for p in model.parameters())


def quantized_size(model: nn.Module, precision: str) -> tuple[int, int]:
    """``(bytes now, bytes once quantised)`` of the Linear weights ``quantize_base`` would replace.

    What the memory estimator uses on its meta-device model, where nothing is really quantised:
    one byte per weight element plus each output row's scale (quanto: one scale in the weight's
    dtype; torchao int8: an fp32 scale and an int8 zero point; torchao fp8: an fp32 scale); for
    ``qint4`` / ``qint2``, :func:`qbits_bytes`.
    """
    if not is_quantized_precision(precision):
        return 0, 0
    before = after = 0
    for layer in quantizable_linears(model).values():
        weight = layer.weight
        before += weight.nbytes
        if precision in _QBITS:
            after += qbits_bytes(weight, _QBITS[precision])
            continue
        row_bytes = _ROW_BYTES[precision] or weight.element_size()
        after += weight.numel() + weight.shape[0] * row_bytes
    return before, after


def quanto_group_size(in_features: int) -> int | None:
    """The group optimum-quanto gives a 4- / 2-bit Linear weight (``QModuleMixin.__init__``): the largest of 128,
    96, 64, 32 dividing ``in_features`` when that is over 128; None (one group per output row) otherwise."""
    if in_features <= 128:
        return None
    return next((size for size in (128, 96, 64, 32) if in_features % size == 0), None)


def qbits_bytes(weight: torch.Tensor, bits: int) -> int:
    """Bytes optimum-quanto keeps for a 4- / 2-bit ``weight`` (out x in): the values packed ``8 // bits`` to a byte
    along the rows of its (groups x group size) view, and a scale and a shift per group in the weight's dtype."""
    rows, columns = weight.shape[0], weight.numel() // weight.shape[0]
    group = quanto_group_size(columns)
    if group is not None:
        rows, columns = weight.numel() // group, group
    return -(-rows * bits // 8) * columns + 2 * rows * weight.element_size()
