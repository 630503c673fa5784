"""``simpletuner estimate --profile``: run a few real training steps on the GPU and compare the
measured peak with the estimate.

The run is the config's own, through the Trainer (datasets, caches, model, optimizer, and the
loop's own step, ``Trainer.run_window``), changed only where the measurement needs it: a few
optimizer steps of one micro-batch each
(accumulation adds no memory: gradients accumulate in place), no validation, checkpoints,
eval loss or trackers, and a throwaway ``output_dir``. The caches are filled as training would
fill them (and reused by the next run). Peak statistics are reset after setup, so the figures
are those of the training steps: the VAE and text encoder used for caching are gone by then.
"""

from __future__ import annotations

import tempfile

import torch

from simpletuner.memory.estimator import GiB, MemoryBreakdown
from simpletuner.memory.report import ProfileResult

#: Config changes for a profiling run (dotted keys, as ``--set`` takes them).
PROFILE_OVERRIDES = {
    "gradient_accumulation_steps": 1,
    "gh200_optimizations.enable_batch_size_rampup": False,
    "validation_prompt": None,
    "validation_prompts": None,
    "validation_steps": None,
    "checkpointing_steps": None,
    "resume_from_checkpoint": None,
    "eval_steps": None,
    "report_to": "none",
    "num_train_epochs": None,
}


class NeedsGPU(RuntimeError):
    """--profile was asked for on a machine without a CUDA device."""


class ProfileOutOfMemory(RuntimeError):
    """The profiled steps ran out of GPU memory: the config does not fit this GPU."""


def profile_overrides(output_dir: str, steps: int) -> list[str]:
    """``--set`` items that turn a config into a profiling run of ``steps`` optimizer steps."""
    import json

    items = [f"{k}={json.dumps(v)}" for k, v in PROFILE_OVERRIDES.items()]
    return items + [f"max_train_steps={steps}", f"output_dir={json.dumps(output_dir)}"]


def profile_training(
    config_path: str, overrides: list[str], breakdown: MemoryBreakdown, steps: int = 3
) -> ProfileResult:
    """Run ``steps`` real training steps of the config at ``config_path`` (with ``overrides``) on
    the current CUDA device; compare its peaks with ``breakdown`` (the estimate of that config)."""
    if not torch.cuda.is_available():
        raise NeedsGPU("--profile runs real training steps and needs a CUDA GPU; this machine has none")
    if steps < 1:
        raise ValueError(f"--profile-steps must be >= 1, got {steps}")
    from simpletuner.configuration import load_config
    from simpletuner.state import StateTracker
    from simpletuner.training.batches import free_memory
    from simpletuner.training.reliability import OutOfMemory
    from simpletuner.training.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="simpletuner-profile-") as out:
        loaded = load_config(config_path, [*overrides, *profile_overrides(out, steps)])
        trainer = Trainer(StateTracker(loaded.config, loaded.raw))
        run_log = trainer.run_log  # setup() opens training.log in the temporary folder: close it with the folder
        try:
            trainer.setup()
            free_memory()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            batches = trainer.data.iterate(trainer.sampler, trainer.accelerator.device)
            for _ in range(steps):
                trainer.run_window(batches)  # the training loop's own step
            torch.cuda.synchronize()
        except (torch.cuda.OutOfMemoryError, OutOfMemory):  # OutOfMemory: run_window's, for an OOM in the step
            peak = torch.cuda.max_memory_reserved()
            del trainer
            free_memory()
            raise ProfileOutOfMemory(
                f"the profiled steps ran out of GPU memory (allocator peak {peak / GiB:.2f} GiB; estimated "
                f"{breakdown.total / GiB:.2f} GiB in all): this config does not fit this GPU as it is"
            ) from None
        finally:
            run_log.close()
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        free, total = torch.cuda.mem_get_info()
        outside = (total - free) - torch.cuda.memory_reserved()  # other processes on the GPU would count here too
        name = torch.cuda.get_device_name()
        del trainer, batches
        free_memory()
    return ProfileResult(
        steps=steps,
        measured_allocated=int(allocated),
        measured_reserved=int(reserved),
        measured_outside_allocator=int(outside) if outside >= 0 else None,
        estimated_allocated=breakdown.total - breakdown.cuda_context - breakdown.fragmentation,
        estimated_reserved=breakdown.total - breakdown.cuda_context,
        estimated_outside_allocator=breakdown.cuda_context,
        estimated_total=breakdown.total,
        device_name=name,
    )
