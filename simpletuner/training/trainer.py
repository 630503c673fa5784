"""The Trainer: a short ``train()`` loop around a separately testable ``train_step()``."""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import torch
from tqdm.auto import tqdm

from simpletuner import locks
from simpletuner.configuration.alloc_conf import ALLOC_CONF_VAR, check_alloc_conf
from simpletuner.data_backend import BucketSampler, build_datasets
from simpletuner.gh200.ramp import AccumulationPolicy, count_steps
from simpletuner.gh200.wiring import configure_runtime
from simpletuner.models import get_model_spec
from simpletuner.state import StateTracker
from simpletuner.training import checkpoint as ckpt
from simpletuner.training import offload, run_folder, runlog
from simpletuner.training import performance as perf
from simpletuner.training.batches import Batch, free_memory, prepare_caches
from simpletuner.training.launch import (
    PhaseClock,
    check_launch_matches,
    from_main_process,
    make_accelerator,
    reset_accelerate_state,
)
from simpletuner.training.lora import trainable_state
from simpletuner.training.optim import build_lr_scheduler, build_optimizer
from simpletuner.training.reliability import (
    NonFiniteLoss,
    OutOfMemory,
    Preempted,
    RunSignals,
    cache_entries_kept,
    run_phase,
)
from simpletuner.training.validation import generate_validation_images

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where the run is; saved in every checkpoint."""

    global_step: int = 0
    micro_batches_seen: int = 0
    samples_seen: int = 0
    skipped_steps: int = 0  # windows whose loss or gradient was not finite (never applied)


@dataclass
class TrainResult:
    """What a finished ``train()`` returns (for callers and tests)."""

    global_step: int
    losses: list[float] = field(default_factory=list)  # window loss per optimizer step this run
    output_path: Path | None = None
    validation_images: list[Path] = field(default_factory=list)


class Trainer:
    """Builds every component from the run's StateTracker, then trains."""

    def __init__(
        self, state: StateTracker, *, hardware=None, peak_tflops: float | None = None, overwrite: bool = False
    ):
        """``hardware`` (a ``simpletuner.memory.hardware.HardwareInfo``) replaces the detected GPU for
        MFU; ``peak_tflops`` (``--peak-tflops``) replaces the GPU table's peak; ``overwrite``
        (``--overwrite``) removes an earlier run's results from ``output_dir`` instead of refusing."""
        self.state = state
        self.overwrite = overwrite
        self.hardware = hardware
        self.peak_tflops = peak_tflops
        self.run_log = runlog.RunLog()  # training.log + metrics.jsonl (rank 0)
        self.config = state.config
        self.output_dir = Path(self.config.output_dir).expanduser()
        self.progress = Progress()
        self.losses: list[float] = []
        self.last_logs: dict[str, float] = {}  # figures of the latest logging window
        self.step_skipped = False
        self.preempt_signum: int | None = None
        self._preempt: RunSignals | None = None  # while the step loop runs: its signal is read at each step
        self._consecutive_skips = 0
        self.validation_images: list[Path] = []

    # --- setup ---------------------------------------------------------------------------
    def _make_accelerator(self):
        return make_accelerator(
            self.mixed_precision,
            self.config.report_to,
            self.output_dir,
            find_unused_parameters=self.spec.needs_unused_parameter_detection,
        )

    def _check_world_size(self) -> None:
        """Stop when the launcher started a different number of processes than Accelerate joined."""
        check_launch_matches(self.accelerator.num_processes, os.environ)

    def setup(self) -> None:
        """Everything before the first step: data, caches, model, optimizer, resume."""
        from accelerate.utils import set_seed

        cfg = self.config
        clock = PhaseClock()
        perf.apply_cuda_allocator(cfg.cuda_allocator)  # before anything touches CUDA
        self.mixed_precision = perf.resolve_mixed_precision(cfg.mixed_precision)
        perf.apply_tf32(cfg.enable_tf32)
        reset_accelerate_state()
        self.spec = spec = get_model_spec(cfg)  # reads the folder's JSON only
        self.accelerator = acc = self._make_accelerator()
        self._check_world_size()
        self._claim_output_dir()  # one output_dir, one run: before anything loads or is written
        self.run_id, self._save_token = ckpt.start_launch(acc, self.output_dir)  # output_dir is ours: clears dead saves
        self.finished_at = run_folder.finished_step(self.output_dir, cfg.resume_from_checkpoint, cfg.max_train_steps)
        if self.finished_at is not None:
            return
        self._log_settings_in_force()
        set_seed(cfg.seed)
        self.accumulation = self._configure_gh200_runtime()
        # Noise and timesteps: one CPU generator per rank, saved and restored with checkpoints.
        self.generator = torch.Generator().manual_seed(cfg.seed + 7919 * acc.process_index)
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_bytes(
                orjson.dumps(self.state.raw_config, option=orjson.OPT_INDENT_2)
            )
        self.run_log.open(self.output_dir, acc.is_main_process)  # before the long work: the cache fill
        self.weight_dtype = perf.PRECISION_DTYPES[self.mixed_precision]

        clock.mark("accelerator")
        run_phase(
            "staging" if any(d.type == "in_memory" for d in cfg.datasets) else "datasets"
        )  # SIGTERM/SIGINT: stop at once
        datasets = build_datasets(self.state)
        clock.mark("datasets")
        from simpletuner.memory.preflight import (
            check_run_memory,
        )  # stops before the cache fill if RAM/GPU cannot hold the run

        check_run_memory(cfg, spec, datasets, self.weight_dtype, self.hardware, acc.num_processes)
        run_phase("cache_fill", kept=cache_entries_kept(lambda: self.state.cache_dirs))  # a stop keeps what is written
        with acc.main_process_first():  # rank 0 encodes; the others then find every entry cached
            self.data, encoders = prepare_caches(
                spec, datasets, Path(cfg.cache_config.cache_dir).expanduser(), acc.device, self.weight_dtype, self.state
            )
        self._keep_for_validation = None
        self._offloaded: tuple = ()  # low_vram: what waits in CPU RAM between validations
        if cfg.validation_prompt_list and acc.is_main_process:
            self._keep_for_validation = (encoders.get_vae(), encoders.get_text())
            if (
                cfg.low_vram
            ):  # in CPU RAM until a validation needs them (the VAE too, unless it re-encodes while training)
                reencodes = cfg.augmentations.is_enabled and cfg.augmentations_cache_mode != "static"
                self._offloaded = self._keep_for_validation[1:] if reencodes else self._keep_for_validation
                offload.to_device(self._offloaded, torch.device("cpu"))
        del encoders
        free_memory()
        clock.mark("caches")

        run_phase("model_load")
        # LoRA trains fp32 adapters on a frozen base held in the autocast precision; full fine-tunes keep fp32 masters.
        denoiser = spec.load_denoiser(self.weight_dtype if cfg.training_type == "lora" else torch.float32)
        denoiser = spec.prepare_denoiser(denoiser, self.weight_dtype)
        if cfg.low_vram:
            spec.apply_low_vram(denoiser)
        denoiser = perf.maybe_compile(denoiser, cfg.enable_compile)
        self._denoiser_fingerprint = ckpt.denoiser_fingerprint(denoiser)
        clock.mark("model")
        optimizer = build_optimizer(cfg, spec.named_parameter_groups(denoiser))
        samples = [s for ds in datasets for s in ds.samples]
        self.sampler = BucketSampler(samples, cfg.train_batch_size, acc.num_processes, acc.process_index, cfg.seed)
        self.eval_samples = samples
        self.eval_batches = self._eval_batches(samples) if cfg.eval_steps else []
        self.total_steps = self._total_steps()
        self.lr_scheduler = build_lr_scheduler(cfg, optimizer, self.total_steps)
        # The schedule is not prepared: Accelerate would step it once per process per step.
        self.flops_per_sample = self._flops_per_sample(denoiser)  # before DDP wraps it (see there)
        self.model, self.optimizer = acc.prepare(denoiser, optimizer)
        # Walking every module for requires_grad each step cost up to ~1 ms (3-10% of a tiny-model step).
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        if cfg.report_to != "none":
            acc.init_trackers(cfg.tracker_project_name, config=_scalar_config(self.state.raw_config))
        clock.mark("optimizer")
        if cfg.resume_from_checkpoint:
            self._resume()
            clock.mark("resume")
            # num_train_epochs: the length is known only now
            self.finished_at = run_folder.finished_step(self.output_dir, cfg.resume_from_checkpoint, self.total_steps)
        self.startup_seconds = clock.phases
        logger.info("start-up: %s", ", ".join(f"{k} {v:.2f}s" for k, v in clock.phases.items()))

    def _log_settings_in_force(self) -> None:
        """Say once, at start, the precision in force and where each launcher-settable key came from."""
        sources = self.state.setting_sources
        precision = sources.get("mixed_precision", "the default: neither the config nor the launcher set it")
        changed = (
            ""
            if self.mixed_precision == self.config.mixed_precision
            else f" (asked for {self.config.mixed_precision!r}; this GPU has no bf16)"
        )
        logger.info("mixed precision %s in force%s, %s", self.accelerator.mixed_precision, changed, precision)
        for key in ("gradient_accumulation_steps", "enable_compile"):
            if key in sources:
                logger.info("%s %s, %s", key, getattr(self.config, key), sources[key])
        for line in self.state.startup_notes:
            logger.info("%s", line)
        for warning in check_alloc_conf(
            os.environ.get(ALLOC_CONF_VAR)
        ).warnings():  # its errors stopped the run earlier
            logger.warning(warning)

    def _configure_gh200_runtime(self) -> AccumulationPolicy:
        """Apply ``cache_config`` / ``gh200_optimizations``: hint override, accumulation policy,
        decisions recorded in the StateTracker and ``<output_dir>/gh200_runtime.json``."""
        acc = self.accelerator
        return configure_runtime(self.state, acc.num_processes, acc.is_main_process, self.output_dir)

    def _eval_batches(self, samples) -> list[Batch]:
        """``eval_iters`` fixed micro-batches (a sampler of their own, so training order is untouched)."""
        acc = self.accelerator
        sampler = BucketSampler(
            samples, self.config.train_batch_size, acc.num_processes, acc.process_index, self.config.seed + 1
        )
        batches = iter(sampler)
        return [self.data.batch(next(batches), acc.device) for _ in range(min(self.config.eval_iters, len(sampler)))]

    @torch.no_grad()
    def eval_loss(self) -> float:
        """Mean loss over the fixed eval batches with the same noise and timesteps every time."""
        acc = self.accelerator
        generator = torch.Generator().manual_seed(self.config.seed + 104729 + acc.process_index)
        self.model.eval()
        try:
            with acc.autocast():
                losses = [
                    self.spec.training_loss(self.model, b.latents, b.conditioning, generator).mean()
                    for b in self.eval_batches
                ]
        finally:
            self.model.train()
        local = torch.stack(losses).mean().reshape(1).to(acc.device)
        return acc.gather(local).mean().item()

    def _flops_per_sample(self, model: torch.nn.Module) -> float | None:
        """Forward + backward FLOPs per sample, counted once on a throwaway micro-batch.

        Counting a real step would perturb it (the counter changes how some backward kernels
        run), so this runs one extra forward and backward with the RNG forked, then drops the
        gradients: training is bit-identical with or without it. It runs before DDP wraps the
        model: a backward DDP sees (even under no_sync) marks the parameters it reached as used
        for the first real all-reduce, which with find_unused_parameters fails on a Wan 2.2
        expert that step does not reach (its gradient was dropped).
        Skipped under torch.compile, which the counter would disturb.
        """
        cfg, acc = self.config, self.accelerator
        if cfg.enable_compile or not self.eval_samples:
            return None
        sampler = BucketSampler(
            self.eval_samples, cfg.train_batch_size, acc.num_processes, acc.process_index, cfg.seed + 2
        )
        batch = self.data.batch(next(iter(sampler)), acc.device)
        per_sample = perf.flops_per_sample(
            lambda m, gen: self.spec.training_loss(m, batch.latents, batch.conditioning, gen),
            model,
            batch.num_samples,
            acc,
        )
        logger.info("%.3g FLOPs per sample (forward + backward)", per_sample)
        return per_sample

    def _peak_tflops(self) -> float | None:
        """The peak MFU is measured against (--peak-tflops, else the GPU table's); None leaves MFU out."""
        hardware = self.hardware
        if hardware is None and self.peak_tflops is None and torch.cuda.is_available():
            from simpletuner.memory.hardware import detect_hardware

            hardware = detect_hardware()
        return perf.peak_tflops_for_run(hardware, self.mixed_precision, self.config.enable_tf32, self.peak_tflops)

    def _total_steps(self) -> int:
        cfg = self.config
        if cfg.max_train_steps is not None:
            return cfg.max_train_steps
        return count_steps(self.accumulation, cfg.num_train_epochs * len(self.sampler))

    def _identity(self) -> dict:
        cfg = self.config
        return {
            "model_family": cfg.model_family,
            "training_type": cfg.training_type,
            "lora_rank": cfg.lora_rank if cfg.training_type == "lora" else None,
            "lora_targets": self.spec.lora_targets if cfg.training_type == "lora" else None,
            "train_batch_size": cfg.train_batch_size,
            "denoiser_config": self._denoiser_fingerprint,
            "lora_type": cfg.lora_type if cfg.training_type == "lora" else None,
            "lycoris_algo": cfg.lycoris.algo if cfg.training_type == "lora" and cfg.lora_type == "lycoris" else None,
            "base_model_precision": cfg.base_model_precision,
            "train_stages": cfg.train_stages,
            "seed": cfg.seed,  # another seed is another run: its checkpoints are refused, not continued
        }

    # --- checkpoints ---------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        return {
            "global_step": self.progress.global_step,
            "micro_batches_seen": self.progress.micro_batches_seen,
            "samples_seen": self.progress.samples_seen,
            "skipped_steps": self.progress.skipped_steps,
            "sampler": self.sampler.state_dict(),
            "accumulation": self.accumulation.state_dict(),
            "run_id": self.run_id,
            "identity": self._identity(),
        }

    def save_checkpoint(self) -> Path:
        """A resumable checkpoint of this step; LoRA runs also get the adapter the final save writes
        (``spec.save_adapter``), loadable as it is. Full fine-tunes get none: ``trainable.safetensors``
        already holds the whole denoiser, and a second copy would double the checkpoint."""
        model = self.accelerator.unwrap_model(self.model)
        is_lora = self.config.training_type == "lora"
        write_adapter = (lambda folder: self.spec.save_adapter(folder, model)) if is_lora else None
        self._last_saved_path = ckpt.save_checkpoint(
            self.accelerator,
            self.output_dir,
            self.progress.global_step,
            trainable_state(model),
            self.optimizer,
            self.lr_scheduler,
            self._trainer_state(),
            self.generator,
            self.config.checkpoints_total_limit,
            scaler=self.accelerator.scaler,
            write_adapter=write_adapter,
            token=self._save_token,
        )
        self._last_saved_step = self.progress.global_step  # once it is complete: a failed save saved nothing
        return self._last_saved_path

    def _claim_output_dir(self) -> None:
        """Lock ``output_dir`` for this run (rank 0), held until ``train()`` ends with the cache locks
        prepare_caches adds (simpletuner/locks.py); then refuse to write over another run's
        results there (run_folder.check_output_dir), or with ``overwrite`` remove them first (rank 0;
        the others wait). The lock comes first, so ``--overwrite`` never removes what a live run writes."""
        cfg, acc = self.config, self.accelerator
        held = self.__dict__.setdefault("_locks", ExitStack())  # setup() without train(): freed with the trainer
        refusal = None
        if acc.is_main_process:
            try:
                held.enter_context(locks.hold_output_dir(self.output_dir))
            except ValueError as exc:  # FolderLocked, or a lock file that cannot be created
                refusal = exc
        # One answer on every rank: none hangs in a collective, all exit 2.
        text = from_main_process(acc, None if refusal is None else str(refusal))
        if text is not None and refusal is None:
            refusal = run_folder.RunFolderTaken(text)  # printed by rank 0 alone (train.main)
        if refusal is not None:
            raise refusal
        self.state.run_locks = held  # prepare_caches adds the cache folder's, once the run starts using it
        if not self.overwrite:
            self._denoiser_fingerprint = None  # known once the model is loaded; not compared here
            identity = {k: v for k, v in self._identity().items() if k != "denoiser_config"}
            run_folder.check_output_dir(self.output_dir, cfg.resume_from_checkpoint, identity)
            return
        run_folder.check_overwrite(self.output_dir, cfg.resume_from_checkpoint)
        if acc.is_main_process:
            run_folder.clear_previous_run(self.output_dir)
        acc.wait_for_everyone()

    def _resume(self) -> None:
        """Continue from the checkpoint ``resume_from_checkpoint`` names, verified against its manifest
        first (a damaged ``latest`` falls back to the newest that verifies; see checkpoint.py). Every
        file is read before any state is applied, and the run adopts the checkpoint's run id."""
        cfg, acc = self.config, self.accelerator
        path = ckpt.resolve_resume(self.output_dir, cfg.resume_from_checkpoint)
        if path is None:
            logger.info(
                "resume_from_checkpoint='latest' but %s holds no complete checkpoint: starting fresh", self.output_dir
            )
            return
        state = ckpt.read_trainer_state(path)
        ckpt.check_compatible(state, self._identity(), acc.num_processes, path)
        if state.get("accumulation") != self.accumulation.state_dict():
            logger.warning(
                "resuming with a different accumulation schedule (checkpoint %s, config %s): the run continues, "
                "but not with the window sequence it started with",
                state.get("accumulation"),
                self.accumulation.state_dict(),
            )
        tensors = ckpt.load_tensors(path, acc.process_index)
        model = acc.unwrap_model(self.model)
        expected = set(trainable_state(model))
        if set(tensors["trainable"]) != expected:
            raise ValueError(f"{path}: trained parameters do not match this model (different adapter or model?)")
        model.load_state_dict(tensors["trainable"], strict=False)
        self.optimizer.load_state_dict(tensors["optimizer"])
        self.lr_scheduler.load_state_dict(tensors["lr_scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        ckpt.restore_rng(tensors["rng"], self.generator)
        self.progress = Progress(
            state["global_step"], state["micro_batches_seen"], state["samples_seen"], state.get("skipped_steps", 0)
        )
        if acc.scaler is not None and "scaler" in tensors:
            acc.scaler.load_state_dict(tensors["scaler"])
        if state.get("run_id"):
            self.run_id = state["run_id"]
        else:
            logger.info(
                "%s records no run id (an older version wrote it): this run continues as run %s", path, self.run_id
            )
        logger.info(
            "resumed from %s at step %d (%d samples seen; run %s)",
            path,
            self.progress.global_step,
            self.progress.samples_seen,
            self.run_id,
        )

    # --- the step ------------------------------------------------------------------------
    def train_step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """One optimizer step over a window of micro-batches; returns the window loss.

        A window whose loss or gradient norm is not finite never reaches the optimizer: its
        gradients are dropped, nothing advances, and ``self.step_skipped`` is set. Deciding
        that costs one host sync per optimizer step (none per micro-batch); the same sync
        carries the preemption flag so every rank agrees on both.
        """
        acc = self.accelerator
        window_samples = sum(b.num_samples for b in micro_batches)
        total = torch.zeros((), device=acc.device)
        for i, batch in enumerate(micro_batches):
            # Gradients are all-reduced only on the window's last micro-batch.
            sync = nullcontext() if i == len(micro_batches) - 1 else acc.no_sync(self.model)
            with sync:
                per_sample = self.spec.training_loss(self.model, batch.latents, batch.conditioning, self.generator)
                loss = per_sample.sum() / window_samples
                acc.backward(loss)
            total += loss.detach()
        params = self._trainable
        if self.config.max_grad_norm:
            norm = acc.clip_grad_norm_(params, self.config.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        self.step_skipped = self._agree(total, norm)
        if self.step_skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.progress.skipped_steps += 1
            self._consecutive_skips += 1
            self._on_nonfinite(micro_batches, total, norm)
            return total
        self._consecutive_skips = 0
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.global_step += 1
        self.progress.micro_batches_seen += len(micro_batches)
        self.progress.samples_seen += window_samples * acc.num_processes
        return total

    def _agree(self, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """Whether any rank saw a non-finite loss or gradient; records an agreed preemption signal."""
        acc = self.accelerator
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm.to(loss.device)))
        signum = float(self._preempt.signum or 0) if self._preempt is not None else 0.0
        flags = torch.stack([bad.float(), torch.tensor(signum, device=loss.device)])
        if acc.num_processes > 1:
            flags = acc.reduce(flags, reduction="max")  # noqa: the one collective of the step
        any_bad, agreed_signum = flags.tolist()
        self.preempt_signum = int(agreed_signum) or None
        return bool(any_bad)

    def _on_nonfinite(self, micro_batches: list[Batch], loss: torch.Tensor, norm: torch.Tensor) -> None:
        cfg = self.config
        keys = [s.key for b in micro_batches for s in b.samples]
        where = (
            f"the window after step {self.progress.global_step} (loss {loss.item():.4g}, gradient norm "
            f"{norm.item():.4g}; samples {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''})"
        )
        if cfg.nonfinite_policy == "skip" and self._consecutive_skips < cfg.max_consecutive_nonfinite:
            logger.warning(
                "skipped %s: not finite (%d in a row, %d this run)",
                where,
                self._consecutive_skips,
                self.progress.skipped_steps,
            )
            return
        path = self.save_checkpoint()
        why = (
            f"{self._consecutive_skips} windows in a row were not finite (max_consecutive_nonfinite="
            f"{cfg.max_consecutive_nonfinite})"
            if cfg.nonfinite_policy == "skip"
            else "nonfinite_policy is 'stop'"
        )
        raise NonFiniteLoss(
            f"non-finite loss or gradient in {where}; {why}. The last good state is saved as {path} (those weights "
            "never saw the bad window). Try a lower learning_rate, max_grad_norm (gradient clipping), bf16 instead "
            "of fp16, or nonfinite_policy 'skip' to step over rare bad batches; then resume_from_checkpoint 'latest'"
        )

    def _out_of_memory(self, exc: BaseException) -> OutOfMemory:
        """Free what the failed step held and explain what would fit (nothing is saved)."""
        self.optimizer.zero_grad(set_to_none=True)
        free_memory()
        from simpletuner.memory.oom import explain_out_of_memory

        return OutOfMemory(explain_out_of_memory(self.config, exc, num_processes=self.accelerator.num_processes))

    # --- the loop ------------------------------------------------------------------------
    def _validate(self) -> None:
        if not (self.config.validation_prompt_list and self.accelerator.is_main_process):
            return
        vae, text = self._keep_for_validation
        model = self.accelerator.unwrap_model(self.model)
        device = self.accelerator.device
        with (
            offload.on_device_while(self.config.low_vram, device, self._offloaded, self.spec.idle_modules(model)),
            self.accelerator.autocast(),
        ):
            self.validation_images += generate_validation_images(
                self.spec,
                model,
                vae,
                text,
                self.config,
                self.progress.global_step,
                self.output_dir / "validation",
                self.accelerator.trackers,
            )

    def train(self) -> TrainResult:
        """Run to ``max_train_steps`` (or the epochs) and save the final weights.

        On rank 0 the log lines also go to ``output_dir/training.log`` and each logging window to
        ``output_dir/metrics.jsonl`` (both appended to across resumes); the lines logged before
        setup knows the output folder are held until it does.
        """
        with self.run_log, ExitStack() as self._locks:  # output_dir and cache locks (_claim_output_dir)
            return self._train()

    def _train(self) -> TrainResult:
        # SIGTERM / SIGINT for the whole run; what one does depends on the phase (reliability.RunSignals):
        # stop at once outside the loop, save at the step boundary inside it, finish the final save first.
        with RunSignals() as signals:
            self.setup()
            cfg, acc = self.config, self.accelerator
            if self.finished_at is not None:  # resumed a run already at max_train_steps: nothing trained, nothing saved
                acc.end_training()
                return TrainResult(self.finished_at)
            if self.progress.global_step == 0 and cfg.validation_prompt_list:
                run_phase("first_validation")
                self._validate()
            batches = self.data.iterate(self.sampler, acc.device)
            bar = tqdm(
                total=self.total_steps,
                initial=self.progress.global_step,
                desc="training",
                disable=not acc.is_local_main_process,
                dynamic_ncols=True,
            )
            meter = perf.ThroughputWindow(
                peak_tflops=self._peak_tflops(), flops_per_sample=self.flops_per_sample, cuda=torch.cuda
            )
            try:
                with signals.flagged() as self._preempt:
                    self._loop(batches, bar, meter)
            finally:
                self._preempt = None
                bar.close()
            self.data.close()  # the persistent decoding threads, if any
            with signals.deferred("final_save", kept=lambda: f"the final weights were saved ({output or 'by rank 0'})"):
                output = self._save_final()
            if cfg.validation_prompt_list and (
                not cfg.validation_steps or self.progress.global_step % cfg.validation_steps
            ):
                run_phase(
                    "final_validation",
                    kept=f"the final weights are saved ({output}); only the last validation images are missing",
                )
                self._validate()
            run_phase("done")
            acc.end_training()
            return TrainResult(self.progress.global_step, self.losses, output, self.validation_images)

    def _loop(self, batches, bar, meter: perf.ThroughputWindow) -> None:
        cfg, acc = self.config, self.accelerator
        pending: list[torch.Tensor] = []
        while self.progress.global_step < self.total_steps:
            window = self.accumulation.window_for(self.progress.micro_batches_seen)
            with meter.data_wait():
                micro = [next(batches) for _ in range(window)]
            if logger.isEnabledFor(logging.DEBUG):
                for b in micro:
                    logger.debug("rank %d micro-batch: %s", acc.process_index, [s.key for s in b.samples])
            local_samples = sum(b.num_samples for b in micro)
            try:
                loss = self.train_step(micro)
            except torch.OutOfMemoryError as exc:
                raise self._out_of_memory(exc) from None
            if self.step_skipped:
                self._stop_if_preempted()
                continue
            pending.append(loss)
            meter.step_done(local_samples)
            step = self.progress.global_step
            bar.update(1)
            if step % cfg.logging_steps == 0 or step == self.total_steps:
                values = torch.stack(pending).tolist()
                self.losses += values
                logs = {"loss": sum(values) / len(values), "lr": self.lr_scheduler.get_last_lr()[0], **meter.report()}
                logs["samples_per_s"] *= acc.num_processes
                logs.update(perf.uvm_memory_figures(perf.managed_pool_stats()))
                if cfg.eval_steps and step % cfg.eval_steps == 0:
                    logs["eval_loss"] = self.eval_loss()
                self.last_logs = logs
                bar.set_postfix(perf.progress_postfix(logs))
                acc.log(logs, step=step)
                self.run_log.write_metrics(step, logs)
                logger.info("step %d/%d %s", step, self.total_steps, perf.log_line(logs))
                pending = []
            if cfg.checkpointing_steps and step % cfg.checkpointing_steps == 0:
                self.save_checkpoint()
            if cfg.validation_steps and step % cfg.validation_steps == 0:
                self._validate()
            self._stop_if_preempted()

    def _stop_if_preempted(self) -> None:
        """At a step boundary that every rank agreed on: save and stop with the signal's exit code."""
        if self.preempt_signum is None:
            return
        if getattr(self, "_last_saved_step", None) == self.progress.global_step:  # this step is saved already
            path = self._last_saved_path
        else:
            path = self.save_checkpoint()
        raise Preempted(self.preempt_signum, path)

    def _save_final(self) -> Path | None:
        """The final adapter (or model), then, with ``checkpoint_at_end``, a checkpoint of the last
        step unless ``checkpointing_steps`` just wrote one: a later run with a higher
        ``max_train_steps`` and ``resume_from_checkpoint: latest`` continues from here.

        The weights are written whole or not at all (``ModelSpec.save_final``). A full disk on
        rank 0 raises NoSpace on every rank (they agree on the outcome first, so none waits in a
        collective for a rank that stopped)."""
        from simpletuner.diskspace import NoSpace

        acc = self.accelerator
        acc.wait_for_everyone()
        path, failure = None, None
        if acc.is_main_process:
            model = acc.unwrap_model(self.model)
            try:
                path = self.spec.save_final(
                    self.output_dir, model, full=self.config.training_type != "lora", step=self.progress.global_step
                )
            except NoSpace as exc:
                failure = exc
            else:
                logger.info("saved %s", path)
        fields = (
            None
            if failure is None
            else (failure.what, str(failure.folder), failure.needed, failure.free, failure.during_write)
        )  # picklable: NoSpace(message) is not
        fields = from_main_process(acc, fields)
        if fields is not None:
            raise failure if failure is not None else NoSpace(*fields, agreed=True)
        acc.wait_for_everyone()
        if self.config.checkpoint_at_end and getattr(self, "_last_saved_step", None) != self.progress.global_step:
            self.save_checkpoint()  # collective, after the adapter: a kill in between resumes and re-saves both
        return path


def _scalar_config(raw: dict) -> dict:
    """Trackers accept flat scalars only."""
    return {k: v for k, v in raw.items() if isinstance(v, (int, float, str, bool))}
