"""Training-memory estimate for a config, with no GPU and no weights read.

The denoiser is built on ``meta`` and set up as the trainer sets it up (exact byte counts for weights,
gradients and optimizer state); one training step runs on fake CPU tensors under ``FakeTensorMode``, with
:class:`~simpletuner.memory.step_memory.StepMemory` counting live bytes by kind (``activations``, and the
step's ``backward_peak``, which the total uses); stated constants below add what a CUDA process holds
besides tensors. ``simpletuner.models`` is imported inside the functions that build a model, so
``import simpletuner.memory`` stays light. Method and limits: documentation/MEMORY.md, "How the estimate is made".
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from simpletuner.memory.autocast import autocast_forward
from simpletuner.memory.optimizer_state import named_optimizer_bytes
from simpletuner.precision import run_dtype

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

MiB = 1 << 20
GiB = 1 << 30

#: CUDA context per process: driver state plus the kernel images torch, cuBLAS and cuDNN load
#: (lazily, ``CUDA_MODULE_LOADING=LAZY`` is the default): ~300-600 MiB on Hopper.
CUDA_CONTEXT_BYTES = 500 * MiB
#: cuBLAS / cuBLASLt workspaces: torch gives a handle 32 MiB on sm_90; the forward (main
#: thread) and the autograd engine's device thread hold one handle each.
CUBLAS_WORKSPACE_BYTES = 2 * 32 * MiB
#: cuDNN convolution workspaces: an allowance for the transient buffers of the chosen conv
#: algorithms, which no tensor-level trace sees. Charged only to models with convolutions.
CUDNN_WORKSPACE_BYTES = 256 * MiB
#: The caching allocator's fragmentation: what is freed and re-allocated every step
#: (activations, gradients, the batch, optimizer temporaries) is reused for differently-sized
#: tensors, so reserved memory exceeds allocated by about this fraction of that dynamic part.
FRAGMENTATION_FRACTION = 0.10

#: Persistent optimizer state per trainable element, in the trainable dtype. Adam/AdamW:
#: exp_avg and exp_avg_sq (their ``step`` counters are CPU scalars unless capturable/fused).
#: SGD: one momentum buffer (``build_optimizer`` always uses momentum 0.9). AdamW-bf16: exp_avg and
#: exp_avg_sq in the parameter's dtype (2 bytes each on bf16 weights, 4 on fp32 ones).
#: Prodigy's state depends on ``slice_p``: see :func:`prodigy_state_bytes`; the optimizers named as SimpleTuner
#: names them (optimi-*, bnb-*, torch-adafactor): :mod:`simpletuner.memory.optimizer_state`.
OPTIMIZER_STATES_PER_ELEMENT = {"adamw": 2, "adam": 2, "sgd": 1, "adamw_bf16": 2}

_DEVICE_KINDS = ("cuda", "cpu")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one training process needs, by component, and what the estimate assumed.

    ``total = weights + gradients + optimizer_state + activations + optimizer_transient +
    not_live_at_once + batch_data + framework_overhead``. ``trainable_weights`` is part of
    ``weights`` and the three overhead parts make up ``framework_overhead`` (neither is added
    again). ``not_live_at_once`` (<= 0) takes back what never coexists: the step peaks either
    in forward/backward (``backward_peak``: activations with the gradients made so far) or in
    the optimizer step (all gradients with its temporaries), whichever is larger.
    """

    weights: int  # every parameter and buffer of the denoiser (frozen base + adapter)
    trainable_weights: int  # the parameters being trained
    gradients: int  # one per trainable element, in the parameter's dtype
    optimizer_state: int  # persistent per-element state (exp_avg, exp_avg_sq, momentum)
    activations: int  # the most ever live of what forward/backward keep or make (traced)
    batch_data: int  # latents + conditioning of one micro-batch
    framework_overhead: int  # cuda_context + workspaces + fragmentation
    total: int
    optimizer_transient: int  # temporaries while the optimizer steps
    backward_peak: int  # the most ever live above weights and batch in forward/backward
    not_live_at_once: int  # <= 0; see above
    cuda_context: int
    workspaces: int
    fragmentation: int
    # --- what was assumed ---
    model_family: str
    micro_batch_size: int
    resolution: int
    latent_shape: tuple[int, ...]
    weight_dtype: str
    trainable_dtype: str
    adapter: str
    optimizer: str
    gradient_checkpointing: bool
    mixed_precision: str
    device_kind: str
    num_parameters: int
    num_trainable_parameters: int

    def headroom(self, usable_bytes: int) -> int:
        """Bytes left of ``usable_bytes`` after this run (negative: it does not fit)."""
        return int(usable_bytes) - self.total

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["latent_shape"] = list(self.latent_shape)
        return out

    def table(self, usable_bytes: int | None = None) -> str:
        """A text table in GiB; with ``usable_bytes``, each row's share of it and the headroom."""
        head = (
            f"{self.model_family} {self.adapter} ({self.optimizer}), micro-batch {self.micro_batch_size} at "
            f"{self.resolution}px (latents {'x'.join(map(str, self.latent_shape))}), mixed precision "
            f"{self.mixed_precision}: weights {self.weight_dtype}, trainable {self.trainable_dtype}; gradient "
            f"checkpointing {'on' if self.gradient_checkpointing else 'off'}; device {self.device_kind}"
        )
        rows = [
            ("weights", self.weights),
            ("  of which trainable", self.trainable_weights),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("activations", self.activations),
            ("optimizer step temporaries", self.optimizer_transient),
            ("not live at once", self.not_live_at_once),
            ("batch data", self.batch_data),
            ("framework overhead", self.framework_overhead),
            ("  CUDA context", self.cuda_context),
            ("  library workspaces", self.workspaces),
            (f"  fragmentation ({FRAGMENTATION_FRACTION:.0%} of dynamic)", self.fragmentation),
            ("total", self.total),
        ]
        width = max(len(name) for name, _ in rows) + 2
        lines = [head, f"{'component':<{width}}{'GiB':>9}" + (f"{'of usable':>11}" if usable_bytes else "")]
        for name, value in rows:
            line = f"{name:<{width}}{value / GiB:>9.2f}"
            if usable_bytes:
                line += f"{100 * value / usable_bytes:>10.1f}%"
            lines.append(line)
        if usable_bytes:
            room = self.headroom(usable_bytes)
            lines.append(f"{'usable':<{width}}{usable_bytes / GiB:>9.2f}")
            lines.append(f"{'headroom':<{width}}{room / GiB:>9.2f}{100 * room / usable_bytes:>10.1f}%")
        return "\n".join(lines)


# --- the model, without weights --------------------------------------------------------------
def _cast_like_from_pretrained(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating tensors as ``from_pretrained(torch_dtype=dtype)`` does, keeping the class's
    ``_keep_in_fp32_modules`` in fp32 (``Module.to`` would not)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        target = torch.float32 if any(k in name.split(".") for k in keep) else dtype
        if tensor.is_floating_point() and tensor.dtype != target:
            tensor.data = tensor.data.to(target)


def build_meta_denoiser(config: "TrainingConfig") -> nn.Module:
    """The denoiser as ``Trainer.setup`` prepares it (dtypes, adapter, checkpointing), on ``meta``.

    Reads ``model_index.json`` and the denoiser's ``config.json``; no weights.
    """
    from simpletuner.models import get_model_spec

    spec = get_model_spec(config)
    weight_dtype = run_dtype(config, cuda=None)  # cuda=None: for the target GPU, not this machine's
    path = str(Path(config.pretrained_model_name_or_path).expanduser())
    if spec.model_index is None:  # a clear error when the folder is not there
        raise ValueError(
            f"{Path(path) / 'model_index.json'} does not exist: the estimator needs a local diffusers-format folder "
            "(configs are enough)"
        )
    with torch.device("meta"):
        model = spec.denoiser_from_config()
        # As the trainer: load in the base dtype, then add the fp32 adapter (or unfreeze all).
        for module in [model] + [m for m in model.modules() if m is not model and hasattr(m, "_keep_in_fp32_modules")]:
            _cast_like_from_pretrained(module, weight_dtype if config.training_type == "lora" else torch.float32)
        model = spec.prepare_denoiser(model, weight_dtype)
        if config.low_vram:
            spec.apply_low_vram(model)  # what waits in CPU RAM is not GPU memory
        return model


def _materialize_fake(model: nn.Module, device: torch.device) -> None:
    """Replace each meta parameter and buffer by an empty tensor of its shape and dtype.

    Called inside a FakeTensorMode, so the replacements are fake (no memory). Not
    ``Module.to_empty``: it swaps tensors in place, which fake parameters refuse.
    """
    done: dict[int, nn.Parameter] = {}  # shared (tied) parameters stay shared
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
                    )
                module._parameters[name] = done[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)


# --- one micro-batch -------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorShape:
    """Shape and dtype of one batch tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def batch_shapes(config: "TrainingConfig", batch_size: int) -> tuple[TensorShape, dict[str, TensorShape]]:
    """Latents and conditioning of one cached micro-batch, as the trainer reads them.

    The family's spec gives the shapes (``ModelSpec.batch_shapes``, from the folder's configs):
    latents are cached in fp32 at the bucket of a square image (``resolution`` x
    ``resolution``, divided by the VAE's down factor); text embeddings in the autocast dtype,
    padded to the tokenizer's max length (with ``train_text_encoder`` int64 token ids instead, which
    the fake step's text encoders embed); with masked loss (a trained dataset with ``mask_data_dir``)
    one fp32 weight per latent pixel (``[B, 1, h, w]``), which the fake step's loss applies too; and what the latent
    entries keep of the pixels (``ModelSpec.pixel_entry_shapes``: an SDXL ControlNet's uint8 conditioning image).
    """
    from simpletuner.configuration.cache_paths import is_trained
    from simpletuner.data_backend.masks import MASK_KEY
    from simpletuner.models import get_model_spec
    from simpletuner.models.text_encoder_lora import is_token_ids

    spec = get_model_spec(config)
    try:
        latents, conditioning = spec.batch_shapes(batch_size)
    except NotImplementedError:
        raise ValueError(f"no batch shapes for model_family {config.model_family!r}") from None
    text_dtype = run_dtype(config, cuda=None)
    shapes = {k: TensorShape(tuple(s), torch.int64 if is_token_ids(k) else text_dtype) for k, s in conditioning.items()}
    # what the latent entries keep of the pixels (an SDXL ControlNet's uint8 conditioning image)
    shapes.update({k: TensorShape(s, dtype) for k, (s, dtype) in spec.pixel_entry_shapes(batch_size).items()})
    if any(ds.mask_data_dir is not None and is_trained(ds) for ds in config.datasets or []):
        shapes[MASK_KEY] = TensorShape((latents[0], 1, *latents[-2:]), torch.float32)
    return TensorShape(tuple(latents), torch.float32), shapes


# --- the fake step ---------------------------------------------------------------------------
def run_fake_step(
    config: "TrainingConfig", batch_size: int, model: nn.Module, make_mode: Callable[[nn.Module, list], Any]
):
    """Turn the meta ``model`` fake and run one step (loss + backward) on a fake batch inside
    the dispatch mode ``make_mode(model, inputs)`` returns; returns that mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from simpletuner.models import get_model_spec

    spec = get_model_spec(config)
    spec.load_noise_scheduler()  # a real object from its config, loaded before faking
    latent_shape, cond_shapes = batch_shapes(config, batch_size)
    device = torch.device("cpu")
    # The only real tensors the step meets are the scheduler's constant tables: converted on use.
    with FakeTensorMode(allow_non_fake_inputs=True):
        _materialize_fake(model, device)
        latents = torch.empty(latent_shape.shape, dtype=latent_shape.dtype, device=device)
        conditioning = {k: torch.empty(s.shape, dtype=s.dtype, device=device) for k, s in cond_shapes.items()}
        mode = make_mode(model, [latents, *conditioning.values()])
        precision = (
            autocast_forward(model, device.type, run_dtype(config, cuda=None))
            if config.mixed_precision != "no"
            else nullcontext(model)
        )
        try:
            with precision as denoiser, mode:
                per_sample = spec.training_loss(denoiser, latents, conditioning, torch.Generator().manual_seed(0))
                (per_sample.sum() / batch_size).backward()  # the trainer's normalisation
        except ValueError as exc:  # the model's own input checks (diffusers raises ValueError for those)
            raise ValueError(
                f"the {config.model_family} denoiser in {config.pretrained_model_name_or_path} refused a training step "
                f"of micro-batch {batch_size} at {config.resolution} px "
                f"(latents {'x'.join(map(str, latent_shape.shape))}): "
                f"{exc} The config asks for something this model does not support (for example a resolution beyond "
                "what its position embedding covers): change the config (resolution, ...) or use the model it was "
                "written for; if both are right, this is a bug in simpletuner, please report it"
            ) from exc
    return mode


def trace_activations(config: "TrainingConfig", batch_size: int, model: nn.Module | None = None) -> tuple[int, int]:
    """``(activations, backward peak)`` of one fake training step: the most bytes of
    activations and temporaries ever live, and the most bytes ever live above the parameters
    and the batch (activations plus the gradients made so far); :class:`~.step_memory.StepMemory`."""
    from simpletuner.memory.step_memory import StepMemory

    tracker = run_fake_step(config, batch_size, model or build_meta_denoiser(config), StepMemory)
    return tracker.peak_activations, tracker.peak_above_resident


def flops_per_step(config: "TrainingConfig", batch_size: int | None = None) -> int:
    """FLOPs of one micro-batch's forward and backward (``FlopCounterMode`` on the fake step)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = run_fake_step(
        config,
        batch_size or config.train_batch_size,
        build_meta_denoiser(config),
        lambda m, i: FlopCounterMode(display=False),
    )
    return int(counter.get_total_flops())


# --- the estimate ----------------------------------------------------------------------------
def automagic_state_bytes(p: torch.Tensor) -> int:
    """Persistent state bytes Automagic keeps for ``p`` (what ``Automagic._init_state`` in
    :mod:`simpletuner.training.optimizers.automagic` allocates): an int16 lr index and an int8 sign
    per element, plus fp32 second moments (a row and a column vector for >= 2-D parameters, one per
    element otherwise). ``tests/test_automagic.py`` checks it against a real optimizer's state."""
    numel = p.numel()
    moments = (p.shape[0] + numel // p.shape[0]) if p.dim() >= 2 else numel
    return numel * (2 + 1) + moments * 4


def prodigy_state_bytes(p: torch.Tensor, slice_p: int = 1) -> int:
    """Persistent state bytes prodigyopt's Prodigy keeps for ``p``, in ``p``'s dtype: exp_avg and
    exp_avg_sq (one element each per element) and the ``d`` statistics ``s`` and ``p0`` (every
    ``slice_p``-th element). An upper bound: a parameter that is all zeros at its first step (a LoRA
    up-projection) keeps a one-element ``p0`` instead. ``tests/test_optimizers_dialect.py`` checks it
    against a real optimizer's state."""
    numel = p.numel()
    return p.element_size() * (2 * numel + 2 * -(-numel // slice_p))


def optimizer_bytes(
    config: "TrainingConfig", trainable: list[nn.Parameter], device_kind: str = "cuda"
) -> tuple[int, int]:
    """``(persistent state, step temporaries)`` of ``config.optimizer`` over ``trainable``.

    Temporaries: torch's multi-tensor (foreach) path, the default on CUDA, makes one full-size
    list for ``sqrt(exp_avg_sq)`` (Adam, AdamW) and, with weight decay, one for
    ``grad + wd * param`` (Adam, SGD; AdamW decays in place). On CPU the per-parameter loop
    needs as much for one tensor at a time.
    """
    named = named_optimizer_bytes(config, trainable, device_kind)  # optimi-*, bnb-*, torch-adafactor
    if named is not None:
        return named
    if config.optimizer == "automagic":
        # Updated one parameter at a time: temporaries of about four fp32 copies of the largest.
        largest = max((p.numel() for p in trainable), default=0)
        return sum(automagic_state_bytes(p) for p in trainable), 4 * 4 * largest
    if config.optimizer == "prodigy":
        # Per parameter: sqrt(exp_avg_sq) + eps, p0 - p and |s|: about three copies of the largest.
        slice_p = config.optimizer_config.get("slice_p", 1)
        assert isinstance(slice_p, int)  # checked with the config: a whole number >= 1
        largest = max((p.nbytes for p in trainable), default=0)
        return sum(prodigy_state_bytes(p, slice_p) for p in trainable), 3 * largest
    if config.optimizer == "adamw_bf16":
        # One parameter at a time: on bf16 weights fp32 copies of weight, gradient, both moments, sqrt and
        # denominator (24 bytes an element); on other dtypes torch AdamW's sqrt and denominator.
        largest = max(
            (p.numel() * (24 if p.dtype == torch.bfloat16 else 2 * p.element_size()) for p in trainable), default=0
        )
        return OPTIMIZER_STATES_PER_ELEMENT["adamw_bf16"] * sum(p.nbytes for p in trainable), largest
    try:
        states = OPTIMIZER_STATES_PER_ELEMENT[config.optimizer]
    except KeyError:
        raise ValueError(f"no optimizer-state rule for optimizer {config.optimizer!r}") from None
    temp_lists = {"adamw": 1, "adam": 1, "sgd": 0}[config.optimizer]
    if config.optimizer in ("adam", "sgd") and config.weight_decay > 0:
        temp_lists += 1
    total = sum(p.nbytes for p in trainable)
    scope = total if device_kind == "cuda" else max((p.nbytes for p in trainable), default=0)
    return states * total, temp_lists * scope


def _adapter_name(config: "TrainingConfig") -> str:
    if config.training_type != "lora":
        return "full"
    name = f"lycoris {config.lycoris.algo}" if config.lora_type == "lycoris" else "lora"
    base = "" if config.base_model_precision == "no_change" else f" on a {config.base_model_precision} base"
    return f"{name} r{config.lora_rank}{base}"


def estimate_memory(
    config: "TrainingConfig", batch_size: int | None = None, *, device_kind: str = "cuda"
) -> MemoryBreakdown:
    """The peak memory of training ``config`` on one device, estimated without a GPU.

    Args:
        config: a validated TrainingConfig; its model folder needs configs only, no weights.
        batch_size: the micro-batch to estimate; default ``config.train_batch_size``.
        device_kind: ``"cuda"`` adds the CUDA context and library workspaces; ``"cpu"`` does not.
    """
    if device_kind not in _DEVICE_KINDS:
        raise ValueError(f"device_kind {device_kind!r} is not one of {', '.join(_DEVICE_KINDS)}")
    batch_size = config.train_batch_size if batch_size is None else batch_size
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    model = build_meta_denoiser(config)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError(
            "nothing to train: no parameter requires a gradient (check training_type and lora_target_modules)"
        )
    weights = sum(p.nbytes for p in params) + sum(b.nbytes for b in model.buffers())
    if config.training_type == "lora":
        from simpletuner.models.adapters.quantize import quantized_size  # lazy: see the note on imports above

        # Quantisation needs real weights, so the meta model keeps them unquantised: count the
        # Linear weights base_model_precision would quantise at 8 bits (plus their row scales).
        unquantized, quantized = quantized_size(model, config.base_model_precision)
        weights += quantized - unquantized
    gradients = sum(p.nbytes for p in trainable)  # one per trainable element, in its dtype
    optimizer_state, optimizer_transient = optimizer_bytes(config, trainable, device_kind)
    latents, conditioning = batch_shapes(config, batch_size)
    batch_data = latents.nbytes + sum(s.nbytes for s in conditioning.values())
    has_conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    base_dtype = run_dtype(config, cuda=None) if config.training_type == "lora" else torch.float32
    num_parameters, num_trainable = sum(p.numel() for p in params), sum(p.numel() for p in trainable)
    trainable_dtype = trainable[0].dtype
    activations, backward_peak = trace_activations(config, batch_size, model)  # makes `model` fake

    step_peak = max(backward_peak, gradients + optimizer_transient)
    not_live_at_once = step_peak - (activations + gradients + optimizer_transient)
    fragmentation = int(FRAGMENTATION_FRACTION * (step_peak + batch_data))
    context = CUDA_CONTEXT_BYTES if device_kind == "cuda" else 0
    workspaces = CUBLAS_WORKSPACE_BYTES + (CUDNN_WORKSPACE_BYTES if has_conv else 0) if device_kind == "cuda" else 0
    overhead = context + workspaces + fragmentation
    return MemoryBreakdown(
        weights=weights,
        trainable_weights=gradients,
        gradients=gradients,
        optimizer_state=optimizer_state,
        activations=activations,
        batch_data=batch_data,
        framework_overhead=overhead,
        total=weights + optimizer_state + step_peak + batch_data + overhead,
        optimizer_transient=optimizer_transient,
        backward_peak=backward_peak,
        not_live_at_once=not_live_at_once,
        cuda_context=context,
        workspaces=workspaces,
        fragmentation=fragmentation,
        model_family=config.model_family,
        micro_batch_size=batch_size,
        resolution=config.resolution,
        latent_shape=tuple(latents.shape[1:]),
        adapter=_adapter_name(config),
        optimizer=config.optimizer,
        gradient_checkpointing=config.gradient_checkpointing,
        mixed_precision=config.mixed_precision,
        device_kind=device_kind,
        weight_dtype=str(base_dtype).removeprefix("torch."),
        trainable_dtype=str(trainable_dtype).removeprefix("torch."),
        num_parameters=num_parameters,
        num_trainable_parameters=num_trainable,
    )
