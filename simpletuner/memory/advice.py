"""What to say when a config does not fit: the dominant component and the switches that would help.

Used by :mod:`simpletuner.memory.autoconfig` (``DoesNotFit``) and ``simpletuner estimate`` for a
config that exceeds the GPU as it is. Switches are offered only where they are not already made,
biggest known saving first, with figures where they are exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from simpletuner.memory.estimator import GiB, MemoryBreakdown

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

#: Names of the rows ``autoconfig.extra_bytes`` adds beside the denoiser's breakdown.
VALIDATION_MODELS = "validation models (VAE + text encoder)"
DDP_BUCKETS = "DDP gradient buckets"

#: Breakdown rows that can dominate a total, with the words used for them.
_COMPONENTS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "batch_data": "batch data",
    "framework_overhead": "framework overhead (CUDA context, library workspaces, fragmentation)",
}


def format_bytes(nbytes: int) -> str:
    """GiB with two decimals; MiB below 0.1 GiB, so small budgets do not read as 0.00."""
    if abs(nbytes) < GiB // 10:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / GiB:.2f} GiB"


def dominant_component(breakdown: MemoryBreakdown, extras: dict[str, int] | None = None) -> tuple[str, int]:
    """The largest row of the breakdown (or of ``extras``): ``(words, bytes)``."""
    rows = [(words, getattr(breakdown, key)) for key, words in _COMPONENTS.items()]
    rows += list((extras or {}).items())
    return max(rows, key=lambda row: row[1])


def suggest_switches(
    config: "TrainingConfig", breakdown: MemoryBreakdown, extras: dict[str, int] | None = None
) -> list[str]:
    """Config changes that would shrink this estimate, each only where it is not already made,
    biggest known saving first; figures are given where they are exact."""
    found: list[tuple[int, str]] = []
    activations = breakdown.activations
    if config.training_type == "full":
        saving = breakdown.gradients + breakdown.optimizer_state
        found.append(
            (
                saving,
                f"training_type: lora (gradients and optimizer state, {format_bytes(saving)} now, "
                "shrink to the adapter's few MiB; the frozen base is held in the mixed precision)",
            )
        )
    if config.mixed_precision == "no":
        if config.training_type == "lora":
            base = breakdown.weights - breakdown.trainable_weights
            found.append(
                (
                    base // 2,
                    f"mixed_precision: bf16 (halves the frozen base, {format_bytes(base)} in fp32, "
                    "and the activations autocast produces)",
                )
            )
        else:
            found.append((activations // 2, "mixed_precision: bf16 (16-bit activations; the fp32 master weights stay)"))
    if not breakdown.gradient_checkpointing:
        found.append(
            (
                activations // 2,
                f"gradient_checkpointing: true (activations, {format_bytes(activations)} now, "
                "are recomputed in the backward pass instead of kept)",
            )
        )
    if config.optimizer in ("adam", "adamw"):
        saving = breakdown.optimizer_state // 2
        found.append(
            (saving, f"optimizer: sgd (one state per trainable element instead of two: saves {format_bytes(saving)})")
        )
    if breakdown.micro_batch_size > 1:
        saving = activations - activations // breakdown.micro_batch_size
        found.append(
            (
                saving,
                f"a smaller train_batch_size (now {breakdown.micro_batch_size}) with more "
                "gradient_accumulation_steps: --target-effective-batch N picks the split",
            )
        )
    if activations > 0.1 * breakdown.total and config.resolution > 256:
        found.append(
            (activations // 2, f"a lower resolution (now {config.resolution}; activations grow with the pixel count)")
        )
    validation = (extras or {}).get(VALIDATION_MODELS, 0)
    if validation:
        found.append((validation, f"no validation_prompt (frees the VAE and text encoder: {format_bytes(validation)})"))
    found.sort(key=lambda item: -item[0])
    return [text for _, text in found]


def does_not_fit_message(
    config: "TrainingConfig", estimate, budget: int, usable: int, margin: float, even: bool
) -> str:
    """Why ``estimate`` (an :class:`~simpletuner.memory.autoconfig.Estimate`) does not fit under
    ``budget``: its size, the dominant component, and the switches that would help. ``even``: it
    is the smallest plan the search has (micro-batch 1 with checkpointing)."""
    breakdown = estimate.breakdown
    words, nbytes = dominant_component(breakdown, estimate.extras)
    setting = f"micro-batch {estimate.micro_batch_size}"
    if estimate.gradient_checkpointing:
        setting += " with gradient checkpointing"
    if budget != usable:
        limit = f"the budget of {format_bytes(budget)} ({margin:.0%} of {format_bytes(usable)} usable)"
    else:
        limit = f"the {format_bytes(usable)} usable"
    lines = [
        f"does not fit: {'even ' if even else ''}{setting} needs {format_bytes(estimate.total)}, above {limit}. "
        f"The largest part is {words}: {format_bytes(nbytes)}."
    ]
    switches = suggest_switches(config, breakdown, estimate.extras)
    if breakdown.cuda_context + breakdown.workspaces >= budget:
        lines.append(
            "The CUDA context and library workspaces alone exceed the budget: this GPU is too small to train on."
        )
    elif switches:
        lines.append("Switches that would help, biggest saving first:")
        lines += [f"  - {switch}" for switch in switches]
    else:
        lines.append("No config switch is left to try: use a GPU with more memory.")
    return "\n".join(lines)


def does_not_fit_advice(config: "TrainingConfig", estimate, usable: int) -> str:
    """The explanation ``DoesNotFit`` carries, for an estimate of the config as it is that
    exceeds the ``usable`` memory."""
    return does_not_fit_message(config, estimate, usable, usable, 1.0, even=False)
