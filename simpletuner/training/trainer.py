"""The Trainer: a short ``train()`` loop around a separately testable ``train_step()``."""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from tqdm.auto import tqdm

from simpletuner.configuration.alloc_conf import ALLOC_CONF_VAR, check_alloc_conf
from simpletuner.data_backend import BucketSampler, build_datasets
from simpletuner.gh200.managed_memory import allocator_settings, place_weights, stop_managed_memory
from simpletuner.gh200.wiring import configure_runtime
from simpletuner.memory.hardware import detect_hardware
from simpletuner.memory.oom import explain_out_of_memory
from simpletuner.memory.preflight import check_run_memory
from simpletuner.models import get_model_spec
from simpletuner.precision import PRECISION_DTYPES, reset_accelerate_state, resolve_mixed_precision
from simpletuner.state import StateTracker
from simpletuner.training import checkpoint as ckpt
from simpletuner.training import knobs, metrics, run_folder, runlog, sharded_state
from simpletuner.training.accumulation import AccumulationPolicy, build_accumulation, count_steps
from simpletuner.training.batches import Batch, free_memory, launch_share, prepare_caches
from simpletuner.training.cpu_threads import CpuThreads, settle_cpu_threads
from simpletuner.training.ema import EMA
from simpletuner.training.launch import PhaseClock, check_launch, check_shared_output_dir, make_accelerator
from simpletuner.training.optim import build_lr_scheduler, build_optimizer
from simpletuner.training.progress import NonFinitePolicy, Progress, StepOutcome, TrainResult, describe_window
from simpletuner.training.reliability import (
    OutOfMemory,
    Preempted,
    RunSignals,
    cache_entries_kept,
    run_phase,
)
from simpletuner.training.run_identity import denoiser_fingerprint, run_identity
from simpletuner.training.validation import EvalLoss, Validator

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch import nn

    from simpletuner.configuration import TrainingConfig
    from simpletuner.data_backend.metadata import Sample
    from simpletuner.models.spec import ModelSpec
    from simpletuner.training.batches import CachedData

logger = logging.getLogger(__name__)


class Trainer:
    """One training run: the components declared below, built by ``setup()`` in the order listed,
    and the loop that trains them.

    ``__init__`` builds nothing: it keeps the run's StateTracker, counters (``progress``) and
    records. ``setup()`` calls the builder named above each group, which assigns that group only,
    in the order their side effects need (the builders' comments say why); with
    ``resume_from_checkpoint``, ``_resume`` puts the checkpoint back last (a resumed run that is
    already finished stops after ``_setup_runtime``).
    ``train()`` is ``setup()``, then ``_loop()``: ``run_window()`` (fetch a window, ``train_step()``
    over it) and what the cadence predicates (``_should_log`` ...) call for; then the final save.
    """

    # _setup_runtime (and the output_dir lock, held in _locks until train() ends)
    mixed_precision: str  # in force: "no", "fp16" or "bf16" (fp16 where the GPU has no bf16)
    spec: ModelSpec
    accelerator: Accelerator
    run_id: str  # made per launch; a resume adopts the checkpoint's
    _save_token: str  # this launch's checkpoint temp-folder token
    cpu_threads: CpuThreads  # torch's CPU thread count and why (training/cpu_threads.py)
    finished_at: int | None  # the step of a resumed run that is already finished: nothing else is built
    accumulation: AccumulationPolicy
    generator: torch.Generator  # noise and timesteps: one per rank, saved and restored with checkpoints
    weight_dtype: torch.dtype
    # _setup_data: the datasets, registered in state.datasets; _setup_caches:
    data: CachedData
    validator: Validator | None  # rank 0, with validation prompts
    # _setup_model
    _denoiser_fingerprint: str | None = None  # in the run identity once the model is loaded
    weight_prefetcher: object | None = None  # managed_memory frozen_weights: hooks prefetching frozen blocks
    # _setup_optimization
    eval_samples: list[Sample]
    sampler: BucketSampler
    evaluator: EvalLoss | None  # with eval_steps
    total_steps: int
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    flops_per_sample: float | None
    model: nn.Module  # prepared by Accelerate (DDP with several processes)
    optimizer: torch.optim.Optimizer
    trainable_params: list[nn.Parameter]
    ema: EMA | None = None  # use_ema, on rank 0: the average of the trained weights
    # setup(), save_checkpoint()
    startup_seconds: dict[str, float]
    _last_saved_step: int | None = None
    _last_saved_path: Path | None = None

    def __init__(
        self, state: StateTracker, *, hardware=None, peak_tflops: float | None = None, overwrite: bool = False
    ):
        """``hardware`` (a ``simpletuner.memory.hardware.HardwareInfo``) replaces the detected GPU for
        MFU; ``peak_tflops`` (``--peak-tflops``) replaces the GPU table's peak; ``overwrite``
        (``--overwrite``) removes an earlier run's results from ``output_dir`` instead of refusing."""
        self.state = state  # the run's registry: config, datasets, cache folders, locks
        self.config: TrainingConfig = state.config
        self.output_dir = Path(self.config.output_dir).expanduser()
        self.overwrite, self.hardware, self.peak_tflops = overwrite, hardware, peak_tflops
        self.run_log = runlog.RunLog()  # training.log + metrics.jsonl (rank 0)
        self.progress = Progress()  # the run's counters, saved in every checkpoint
        self.nonfinite = NonFinitePolicy(self.config)  # what a window that is not finite does
        self.losses: list[float] = []  # the window loss of every optimizer step this run
        self.last_logs: dict[str, float] = {}  # figures of the latest logging window
        self.validation_images: list[Path] = []
        self.preempt_signum: int | None = None  # a stop signal every rank agreed on
        self._preempt: RunSignals | None = None  # while the step loop runs: its signal is read at each step
        self._pending: list[torch.Tensor] = []  # window losses since the last log line

    # --- setup: the builders, in order ---------------------------------------------------
    def setup(self) -> None:
        """Everything before the first step; each builder says what it assigns (see the class doc)."""
        clock = PhaseClock()
        self._setup_runtime()
        if self.finished_at is not None:  # resumed a run already at its last step: nothing to build
            return
        clock.mark("accelerator")
        self._setup_data()
        clock.mark("datasets")
        self._setup_caches()
        clock.mark("caches")
        denoiser = self._setup_model()
        clock.mark("model")
        self._setup_optimization(denoiser)
        clock.mark("optimizer")
        if self.config.resume_from_checkpoint:
            self._resume()
            clock.mark("resume")
            # num_train_epochs: the length is known only now
            self.finished_at = run_folder.finished_step(
                self.output_dir, self.config.resume_from_checkpoint, self.total_steps
            )
        self.startup_seconds = clock.phases
        logger.info("start-up: %s", ", ".join(f"{k} {v:.2f}s" for k, v in clock.phases.items()))

    def _setup_runtime(self) -> None:
        """Process settings, ``spec``, ``accelerator``, the claim on ``output_dir`` (``run_id``), and,
        unless the resumed run is finished (``finished_at``), ``accumulation``, ``generator`` and the
        run's files. The allocator is set before anything touches CUDA, and output_dir is locked
        before anything loads or is written."""
        from accelerate.utils import set_seed

        cfg = self.config
        allocator, notes = allocator_settings(cfg, os.environ)  # managed_memory "all" adds what it needs
        knobs.apply_cuda_allocator(allocator)  # before anything touches CUDA
        for note in notes:
            logger.info("%s", note)
        self.mixed_precision = resolve_mixed_precision(cfg.mixed_precision)
        knobs.apply_tf32(cfg.enable_tf32)
        reset_accelerate_state()
        self.spec = get_model_spec(cfg)  # reads the folder's JSON only
        self.accelerator = acc = make_accelerator(
            self.mixed_precision,
            cfg.report_to,
            self.output_dir,
            find_unused_parameters=self.spec.needs_unused_parameter_detection,
        )
        self.cpu_threads = settle_cpu_threads(cfg.num_cpu_threads, is_cuda=acc.device.type == "cuda")  # before the work
        check_launch(acc, cfg)  # processes, FSDP, one config on every node: before anything loads or is written
        self._claim_output_dir()  # one output_dir, one run: before anything loads or is written
        check_shared_output_dir(acc, self.output_dir)  # every node sees the folder rank 0 holds
        self.run_id, self._save_token = ckpt.start_launch(acc, self.output_dir)  # output_dir is ours: clears dead saves
        self.finished_at = run_folder.finished_step(self.output_dir, cfg.resume_from_checkpoint, cfg.max_train_steps)
        if self.finished_at is not None:
            return
        self._log_settings_in_force()
        set_seed(cfg.seed)
        self.accumulation = self._configure_gh200_runtime()
        self.generator = torch.Generator().manual_seed(cfg.seed + 7919 * acc.process_index)  # a CPU one per rank
        if acc.is_main_process:
            run_folder.write_run_config(self.output_dir, self.state.raw_config)
        self.run_log.open(self.output_dir, acc.is_main_process)  # before the long work: the cache fill
        self.weight_dtype = PRECISION_DTYPES[self.mixed_precision]

    def _setup_data(self) -> None:
        """Build, scan and register the datasets (``state.datasets``, which the later builders read).
        A stop signal here ends the run at once."""
        staging = any(d.type == "in_memory" for d in self.config.datasets)
        run_phase("staging" if staging else "datasets")  # SIGTERM/SIGINT: stop at once
        build_datasets(self.state, self.spec)  # the data is checked to fit the model before any scan

    def _setup_caches(self) -> None:
        """``data`` (every latent and text embedding cached) and ``validator``. Stops first when RAM or
        GPU cannot hold the run; then every rank encodes its part of what is missing and reads the others'."""
        cfg, acc, spec, datasets = self.config, self.accelerator, self.spec, self.state.datasets
        run_phase("memory_check")
        check_run_memory(cfg, spec, datasets, self.weight_dtype, self.hardware, acc.num_processes)
        run_phase("cache_fill", kept=cache_entries_kept(lambda: self.state.cache_dirs))  # a stop keeps what is written
        cache_dir = Path(cfg.cache_config.cache_dir).expanduser()
        self.data, encoders = prepare_caches(
            spec, datasets, cache_dir, acc.device, self.weight_dtype, self.state, launch_share(acc)
        )
        self.validator = None
        if cfg.validation_prompt_list and acc.is_main_process:
            self.validator = Validator(spec, cfg, encoders, self.output_dir, datasets)
        del encoders
        free_memory()  # the encoders the validator does not keep

    def _setup_model(self) -> torch.nn.Module:
        """The denoiser, ready to train (adapters, low_vram, compile): handed to ``_setup_optimization``."""
        cfg, spec = self.config, self.spec
        run_phase("model_load")
        # LoRA trains fp32 adapters on a frozen base held in the autocast precision; full fine-tunes keep fp32 masters.
        denoiser = spec.load_denoiser(self.weight_dtype if cfg.training_type == "lora" else torch.float32)
        denoiser = spec.prepare_denoiser(denoiser, self.weight_dtype)
        # managed_memory frozen_weights: the frozen base lives in CPU memory, prefetched block by block.
        self.weight_prefetcher = place_weights(denoiser, self.state.gh200_runtime_config["managed_memory"])
        if cfg.low_vram:
            spec.apply_low_vram(denoiser)
        denoiser = knobs.maybe_compile(denoiser, cfg.enable_compile)
        self._denoiser_fingerprint = denoiser_fingerprint(denoiser)
        return denoiser

    def _setup_optimization(self, denoiser: torch.nn.Module) -> None:
        """``sampler`` (its length sets ``total_steps`` for epoch runs), the eval batches, ``lr_scheduler``,
        ``flops_per_sample``, then ``model`` / ``optimizer`` prepared by Accelerate, and the trackers."""
        cfg, acc = self.config, self.accelerator
        optimizer = build_optimizer(cfg, self.spec.named_parameter_groups(denoiser))
        samples = [s for ds in self.state.datasets for s in ds.samples]
        weights = {ds.id: ds.config.probability for ds in self.state.datasets}  # datasets[].probability
        self.sampler = BucketSampler(
            samples, cfg.train_batch_size, acc.num_processes, acc.process_index, cfg.seed, weights=weights
        )
        self.eval_samples = samples
        self.evaluator = EvalLoss(self.spec, self.data, samples, cfg, acc) if cfg.eval_steps else None
        steps, epochs = cfg.max_train_steps, cfg.num_train_epochs  # epochs: count the windows the ramp makes
        self.total_steps = steps if steps is not None else count_steps(self.accumulation, epochs * len(self.sampler))
        self.lr_scheduler = build_lr_scheduler(cfg, optimizer, self.total_steps, acc.num_processes)
        # The schedule is not prepared: Accelerate would step it once per process per step.
        self.flops_per_sample = self._flops_per_sample(denoiser)  # before DDP wraps it (see there)
        self.model, self.optimizer = acc.prepare(denoiser, optimizer)
        # Walking every module for requires_grad each step cost up to ~1 ms (3-10% of a tiny-model step).
        self.trainable_params = [p for p in self.model.parameters() if p.requires_grad]
        if cfg.use_ema and acc.is_main_process:  # every rank holds the same weights: rank 0 averages them
            self.ema = EMA.for_model(acc.unwrap_model(self.model), cfg, acc.device)
        if cfg.report_to != "none":
            acc.init_trackers(cfg.tracker_project_name, config=_scalar_config(self.state.raw_config))

    def _log_settings_in_force(self) -> None:
        """Say once, at start, the precision in force and where each launcher-settable key came from."""
        sources, asked = self.state.setting_sources, self.config.mixed_precision
        precision = sources.get("mixed_precision", "the default: neither the config nor the launcher set it")
        changed = "" if self.mixed_precision == asked else f" (asked for {asked!r}; this GPU has no bf16)"
        logger.info("mixed precision %s in force%s, %s", self.accelerator.mixed_precision, changed, precision)
        logger.log(self.cpu_threads.level, "%s", self.cpu_threads.line)
        for key in [k for k in ("gradient_accumulation_steps", "enable_compile") if k in sources]:
            logger.info("%s %s, %s", key, getattr(self.config, key), sources[key])
        for line in self.state.startup_notes:
            logger.info("%s", line)
        for warning in check_alloc_conf(os.environ.get(ALLOC_CONF_VAR)).warnings():  # its errors stopped the run
            logger.warning(warning)

    def _configure_gh200_runtime(self) -> AccumulationPolicy:
        """Apply ``cache_config`` / ``gh200_optimizations``: hint override, accumulation policy,
        decisions recorded in the StateTracker and ``<output_dir>/gh200_runtime.json``."""
        acc = self.accelerator
        policy = build_accumulation(self.config, acc.num_processes)
        decided = configure_runtime(
            self.state, acc.num_processes, acc.is_main_process, self.output_dir, accumulation=policy.state_dict()
        )
        # managed_memory "all" routes every allocation to the pool from here until train() ends
        self.__dict__.setdefault("_locks", ExitStack()).callback(stop_managed_memory, decided["managed_memory"])
        return policy

    def eval_loss(self) -> float:
        """Mean loss over the fixed eval batches with the same noise and timesteps every time."""
        return self.evaluator(self.model)

    @property
    def eval_batches(self) -> list[Batch]:
        return self.evaluator.batches if self.evaluator is not None else []

    def _flops_per_sample(self, model: torch.nn.Module) -> float | None:
        """Forward + backward FLOPs per sample, counted once on a throwaway micro-batch (counting a
        real step would perturb it: see metrics.flops_per_sample). It runs before DDP wraps the
        model: a backward DDP sees (even under no_sync) marks the parameters it reached as used
        for the first real all-reduce, which with find_unused_parameters fails on a Wan 2.2
        expert that step does not reach. Skipped under torch.compile, which the counter would disturb.
        """
        cfg, acc = self.config, self.accelerator
        if cfg.enable_compile or not self.eval_samples:
            return None
        sampler = BucketSampler(
            self.eval_samples, cfg.train_batch_size, acc.num_processes, acc.process_index, cfg.seed + 2
        )
        batch = self.data.batch(next(iter(sampler)), acc.device)
        per_sample = metrics.flops_per_sample(
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
            hardware = detect_hardware()
        return metrics.peak_tflops_for_run(hardware, self.mixed_precision, self.config.enable_tf32, self.peak_tflops)

    def _identity(self) -> dict:
        return run_identity(self.config, self.spec, self._denoiser_fingerprint)

    # --- checkpoints ---------------------------------------------------------------------
    def _checkpoint_parts(self) -> ckpt.CheckpointParts:
        model, acc = self.accelerator.unwrap_model(self.model), self.accelerator
        parts = (self.optimizer, self.lr_scheduler, self.generator, self.progress, self.sampler, self.accumulation)
        return ckpt.CheckpointParts(model, *parts, scaler=acc.scaler, ema=self.ema)

    def save_checkpoint(self) -> Path:
        """A resumable checkpoint of this step; LoRA runs also get the adapter the final save writes
        (``spec.save_adapter``), loadable as it is. Full fine-tunes get none: ``trainable.safetensors``
        already holds the whole denoiser, and a second copy would double the checkpoint."""
        parts = self._checkpoint_parts()
        is_lora = self.config.training_type == "lora"
        self._last_saved_path = ckpt.save_parts(
            self.accelerator,
            self.output_dir,
            self.progress.global_step,
            parts,
            run_id=self.run_id,
            identity=self._identity(),
            total_limit=self.config.checkpoints_total_limit,
            write_adapter=(lambda folder: self.spec.save_adapter(folder, parts.model)) if is_lora else None,
            token=self._save_token,
        )
        self._last_saved_step = self.progress.global_step  # once it is complete: a failed save saved nothing
        return self._last_saved_path

    def _resume(self) -> None:
        """Continue from the checkpoint ``resume_from_checkpoint`` names, verified against its manifest
        first (a damaged ``latest`` falls back to the newest that verifies; see checkpoint.py). Every
        file is read before any state is applied, and the run adopts the checkpoint's run id."""
        path = ckpt.resolve_resume(self.output_dir, self.config.resume_from_checkpoint)
        if path is None:
            logger.info(
                "resume_from_checkpoint='latest' but %s holds no complete checkpoint: starting fresh", self.output_dir
            )
            return
        state = ckpt.restore_parts(path, self.accelerator, self._checkpoint_parts(), self._identity())
        if state.get("run_id"):
            self.run_id = state["run_id"]
        else:
            logger.info(
                "%s records no run id (an older version wrote it): this run continues as run %s", path, self.run_id
            )
        at = (self.progress.global_step, self.progress.samples_seen)
        logger.info("resumed from %s at step %d (%d samples seen; run %s)", path, *at, self.run_id)

    def _claim_output_dir(self) -> None:
        """Lock ``output_dir`` for this run (rank 0), held until ``train()`` ends with the cache locks
        prepare_caches adds (simpletuner/locks.py); then refuse to write over another run's results
        there, or with ``overwrite`` remove them first (run_folder.take_output_dir)."""
        held = self.__dict__.setdefault("_locks", ExitStack())  # setup() without train(): freed with the trainer
        run_folder.lock_output_dir(self.accelerator, self.output_dir, held)
        self.state.run_locks = held  # prepare_caches adds the cache folder's, once the run starts using it
        identity = {k: v for k, v in self._identity().items() if k != "denoiser_config"}  # no model loaded yet
        run_folder.take_output_dir(
            self.accelerator, self.output_dir, self.config.resume_from_checkpoint, identity, self.overwrite
        )

    # --- the step ------------------------------------------------------------------------
    def run_window(self, batches: Iterator[Batch], meter: metrics.ThroughputWindow | None = None) -> StepOutcome:
        """Take the next accumulation window from ``batches`` (the policy's length for the micro-batches
        seen so far; the wait is ``meter``'s data time) and make one optimizer step over it.
        An out-of-memory step raises OutOfMemory, which says what would fit."""
        window = self.accumulation.window_for(self.progress.micro_batches_seen)
        with meter.data_wait() if meter is not None else nullcontext():
            micro = [next(batches) for _ in range(window)]
        if logger.isEnabledFor(logging.DEBUG):
            for b in micro:
                logger.debug("rank %d micro-batch: %s", self.accelerator.process_index, [s.key for s in b.samples])
        try:
            return self.train_step(micro)
        except torch.OutOfMemoryError as exc:
            raise self._out_of_memory(exc) from None

    def train_step(self, micro_batches: list[Batch]) -> StepOutcome:
        """One optimizer step over a window of micro-batches: the loss is each sample's loss summed
        over the window and divided by the window's samples, whatever the micro-batch sizes.

        A window whose loss or gradient norm is not finite never reaches the optimizer: its
        gradients are dropped, nothing advances (``progress.skipped_steps`` counts it) and the
        outcome says ``skipped``. Deciding that costs one host sync per optimizer step (none per
        micro-batch); the same sync carries the preemption flag so every rank agrees on both.
        """
        acc = self.accelerator
        window_samples = sum(b.num_samples for b in micro_batches)
        total = torch.zeros((), device=acc.device)
        for i, batch in enumerate(micro_batches):
            # Gradients are all-reduced only on the window's last micro-batch.
            sync = nullcontext() if i == len(micro_batches) - 1 else acc.no_sync(self.model)
            with sync:
                per_sample = self.spec.training_loss(
                    self.model,
                    batch.latents,
                    batch.conditioning,
                    self.generator,
                    is_regularisation_data=batch.is_regularisation_data,
                )
                loss = per_sample.sum() / window_samples
                acc.backward(loss)
            total += loss.detach()
        params = self.trainable_params
        if self.config.max_grad_norm and self.config.grad_clip_method == "norm":
            norm = acc.clip_grad_norm_(params, self.config.max_grad_norm)
        else:  # the norm before any clipping: it decides whether the window is finite
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            if self.config.max_grad_norm:
                acc.clip_grad_value_(params, self.config.max_grad_norm)
        norm = sharded_state.plain(norm)  # FSDP: a DTensor, reduced to its value
        if self._agree(total, norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.progress.skipped_steps += 1
            where = describe_window(self.progress.global_step, total, norm, micro_batches)
            self.nonfinite.failed(where, self.progress.skipped_steps, self.save_checkpoint)
            return StepOutcome(total, skipped=True, num_samples=window_samples)
        self.nonfinite.passed()
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.global_step += 1
        self.progress.micro_batches_seen += len(micro_batches)
        self.progress.samples_seen += window_samples * acc.num_processes
        if self.ema is not None:  # after a real optimizer step only: a skipped window returned above
            self.ema.step(self.progress.global_step)
        return StepOutcome(total, skipped=False, num_samples=window_samples)

    def _agree(self, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """Whether any rank saw a non-finite loss or gradient; records an agreed preemption signal."""
        acc = self.accelerator
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm.to(loss.device)))
        signum = float(self._preempt.signum or 0) if self._preempt is not None else 0.0
        flags = torch.stack([bad.float(), torch.tensor(signum, device=loss.device)])
        if acc.num_processes > 1:
            flags = acc.reduce(flags, reduction="max")  # the one collective of the step
        any_bad, agreed_signum = flags.tolist()
        self.preempt_signum = int(agreed_signum) or None
        return bool(any_bad)

    def _out_of_memory(self, exc: BaseException) -> OutOfMemory:
        """Free what the failed step held and explain what would fit (nothing is saved)."""
        self.optimizer.zero_grad(set_to_none=True)
        free_memory()
        return OutOfMemory(explain_out_of_memory(self.config, exc, num_processes=self.accelerator.num_processes))

    # --- the loop ------------------------------------------------------------------------
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
            acc = self.accelerator
            if self.finished_at is not None:  # resumed a run already at max_train_steps: nothing trained, nothing saved
                acc.end_training()
                return TrainResult(self.finished_at)
            if self.progress.global_step == 0 and self.config.validation_prompt_list:
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
            meter = metrics.ThroughputWindow(
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
            if self._should_validate_at_end():
                run_phase(
                    "final_validation",
                    kept=f"the final weights are saved ({output}); only the last validation images are missing",
                )
                self._validate()
            run_phase("done")
            acc.end_training()
            return TrainResult(self.progress.global_step, self.losses, output, self.validation_images)

    def _loop(self, batches: Iterator[Batch], bar, meter: metrics.ThroughputWindow) -> None:
        while self.progress.global_step < self.total_steps:
            outcome = self.run_window(batches, meter)
            if not outcome.skipped:
                self._after_step(outcome, bar, meter)
            self._stop_if_preempted()

    def _after_step(self, outcome: StepOutcome, bar, meter: metrics.ThroughputWindow) -> None:
        """What the cadence asks for after optimizer step ``progress.global_step``."""
        step = self.progress.global_step
        self._pending.append(outcome.loss)
        meter.step_done(outcome.num_samples)
        bar.update(1)
        if self._should_log(step):
            self._log_window(step, bar, meter)
        if self._should_checkpoint(step):
            self.save_checkpoint()
        if self._should_validate(step):
            self._validate()

    # --- cadence -------------------------------------------------------------------------
    def _should_log(self, step: int) -> bool:
        return step % self.config.logging_steps == 0 or step == self.total_steps

    def _should_checkpoint(self, step: int) -> bool:
        return bool(self.config.checkpointing_steps) and step % self.config.checkpointing_steps == 0

    def _should_validate(self, step: int) -> bool:
        """Whether the loop validates after ``step`` (rank 0 renders, when there are prompts)."""
        return bool(self.config.validation_steps) and step % self.config.validation_steps == 0

    def _should_validate_at_end(self) -> bool:
        """Validation prompts are set and the loop did not just validate the last step."""
        return bool(self.config.validation_prompt_list) and not self._should_validate(self.progress.global_step)

    def _should_checkpoint_at_end(self) -> bool:
        """``checkpoint_at_end``, unless ``checkpointing_steps`` just saved the last step."""
        return self.config.checkpoint_at_end and self._last_saved_step != self.progress.global_step

    # --- what the cadence calls ----------------------------------------------------------
    def _log_window(self, step: int, bar, meter: metrics.ThroughputWindow) -> None:
        """Log the window since the last log line: mean loss, learning rate, throughput (+ eval_loss)."""
        acc = self.accelerator
        values = torch.stack(self._pending).tolist()
        self.losses += values
        logs = {"loss": sum(values) / len(values), "lr": self.lr_scheduler.get_last_lr()[0], **meter.report()}
        logs["samples_per_s"] *= acc.num_processes
        logs.update(metrics.uvm_memory_figures(metrics.managed_pool_stats()))
        if self.config.eval_steps and step % self.config.eval_steps == 0:
            logs["eval_loss"] = self.eval_loss()
        self.last_logs = logs
        bar.set_postfix(metrics.progress_postfix(logs))
        acc.log(logs, step=step)
        self.run_log.write_metrics(step, logs)
        logger.info("step %d/%d %s", step, self.total_steps, metrics.log_line(logs))
        self._pending = []

    def _validate(self) -> None:
        if self.validator is None:  # not rank 0, or no validation prompts
            return
        model = self.accelerator.unwrap_model(self.model)
        self.validation_images += self.validator.render(
            model, self.progress.global_step, self.accelerator, ema=self.ema
        )

    def _stop_if_preempted(self) -> None:
        """At a step boundary that every rank agreed on: save and stop with the signal's exit code."""
        if self.preempt_signum is None:
            return
        if self._last_saved_step == self.progress.global_step:  # this step is saved already
            path = self._last_saved_path
        else:
            path = self.save_checkpoint()
        raise Preempted(self.preempt_signum, path, self.state.resume_command)

    def _save_final(self) -> Path | None:
        """The final adapter (or model), then, with ``checkpoint_at_end``, a checkpoint of the last
        step unless ``checkpointing_steps`` just wrote one: a later run with a higher
        ``max_train_steps`` and ``resume_from_checkpoint: latest`` continues from here.
        The weights are written whole or not at all, and a full disk on rank 0 stops every rank
        (run_folder.save_final_weights)."""
        full = self.config.training_type != "lora"
        model = self.accelerator.unwrap_model(self.model)
        path = run_folder.save_final_weights(
            self.accelerator, self.spec, model, self.output_dir, full, self.progress.global_step, ema=self.ema
        )
        if path is not None:
            logger.info("saved %s", path)
        if self._should_checkpoint_at_end():
            self.save_checkpoint()  # collective, after the adapter: a kill in between resumes and re-saves both
        return path


def _scalar_config(raw: dict) -> dict:
    """Trackers accept flat scalars only."""
    return {k: v for k, v in raw.items() if isinstance(v, (int, float, str, bool))}
