"""The Trainer: a short ``train()`` loop around a separately testable ``train_step()``."""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from tqdm.auto import tqdm

from simpletuner.caching.fill import fill_caches
from simpletuner.caching.share import launch_share
from simpletuner.configuration.alloc_conf import ALLOC_CONF_VAR, check_alloc_conf
from simpletuner.data_backend import BucketSampler, build_datasets
from simpletuner.gh200.managed_memory import allocator_settings, place_weights, stop_managed_memory
from simpletuner.gh200.wiring import configure_runtime
from simpletuner.hardware.machine import detect_hardware
from simpletuner.memory.preflight import check_run_memory
from simpletuner.models import get_model_spec
from simpletuner.precision import PRECISION_DTYPES, reset_accelerate_state, resolve_mixed_precision
from simpletuner.startup import INTERPRETER, StartupTimeline
from simpletuner.state import StateTracker
from simpletuner.training import checkpoint as ckpt
from simpletuner.training import knobs, metrics, run_folder, runlog, sharded_state
from simpletuner.training.accumulation import AccumulationPolicy, build_accumulation, count_steps
from simpletuner.training.batches import Batch, CachedData, CaptionDropout, MaskedLoss, free_memory
from simpletuner.training.cpu_threads import CpuThreads, settle_cpu_threads
from simpletuner.training.ema import EMA
from simpletuner.training.launch import check_launch, check_shared_output_dir, make_accelerator
from simpletuner.training.optim import build_lr_scheduler, build_optimizer
from simpletuner.training.progress import NonFinitePolicy, Progress, StepOutcome, TrainResult, describe_window
from simpletuner.training.publish import RunUploads, remove_staging
from simpletuner.training.reliability import (
    OutOfMemory,
    Preempted,
    RunSignals,
    cache_entries_kept,
    run_phase,
    run_step,
)
from simpletuner.training.rng import noise_generator
from simpletuner.training.run_identity import denoiser_fingerprint, run_identity

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch import nn

    from simpletuner.configuration import TrainingConfig
    from simpletuner.data_backend.factory import RegisteredDataset
    from simpletuner.data_backend.metadata import Sample
    from simpletuner.gh200.managed_memory import ManagedMemoryPlan
    from simpletuner.gh200.wiring import RuntimeDecisions
    from simpletuner.models.spec import ModelSpec
    from simpletuner.training.validation import EvalLoss, Validator

logger = logging.getLogger(__name__)


class Trainer:
    """One training run: the components declared below, built by ``setup()``, and the loop that trains them.

    ``__init__`` builds nothing: it keeps the run's StateTracker (the run's record), counters (``progress``)
    and records. ``setup()`` calls the builders in order: each takes what an earlier one built as arguments,
    returns what a later one needs and assigns the components listed under its name below. A resumed run
    that is already finished stops after ``_claim_run``. ``train()`` is ``setup()``, then ``_loop()``:
    ``run_window()`` (fetch a window, ``train_step()`` over it), what the step's outcome asks for (a stop)
    and what the cadence predicates (``_should_log`` ...) call for; then the final save.
    """

    # _setup_process
    mixed_precision: str  # in force: "no", "fp16" or "bf16" (fp16 where the GPU has no bf16)
    weight_dtype: torch.dtype
    spec: ModelSpec
    accelerator: Accelerator
    cpu_threads: CpuThreads  # torch's CPU thread count and why (training/cpu_threads.py)
    generator: torch.Generator  # noise and timesteps: one per rank, saved and restored with checkpoints
    # _claim_run (the output_dir lock is held on the run's lock stack until train() ends)
    run_id: str  # made per launch; a resume adopts the checkpoint's
    checkpointer: ckpt.Checkpointer  # this launch's saves
    # _start_run
    accumulation: AccumulationPolicy
    runtime: RuntimeDecisions  # cache_config / gh200_optimizations as decided (recorded in the StateTracker)
    # _setup_data returns the datasets (recorded in the StateTracker); _setup_caches:
    data: CachedData
    validator: Validator | None  # rank 0, with validation prompts
    # _setup_model
    _denoiser_fingerprint: str | None = None  # in the run identity once the model is loaded
    weight_prefetcher: object | None = None  # managed_memory frozen_weights: hooks prefetching frozen blocks
    # _setup_sampling
    sampler: BucketSampler
    evaluator: EvalLoss | None  # with eval_steps
    flops_per_sample: float | None
    # _setup_optimizer
    model: nn.Module  # prepared by Accelerate (DDP with several processes)
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    trainable_params: list[nn.Parameter]
    ema: EMA | None = None  # use_ema, on rank 0: the average of the trained weights
    # setup(), save_checkpoint()
    total_steps: int
    startup_seconds: dict[str, float]
    _last_saved_step: int | None = None
    _last_saved_path: Path | None = None
    _setup_locks: ExitStack | None = None  # setup() without train(): its locks, released with the trainer
    uploads: RunUploads | None = None  # push_to_hub, rank 0: the Hub uploads of this run

    def __init__(
        self,
        state: StateTracker,
        *,
        hardware=None,
        peak_tflops: float | None = None,
        overwrite: bool = False,
        startup: StartupTimeline | None = None,
    ):
        """``hardware`` (a ``simpletuner.hardware.machine.HardwareInfo``) replaces the detected GPU for
        MFU; ``peak_tflops`` (``--peak-tflops``) replaces the GPU table's peak; ``overwrite``
        (``--overwrite``) removes an earlier run's results from ``output_dir`` instead of refusing;
        ``startup``: the timeline ``simpletuner train`` began (process start, config, imports), which
        setup and the first step go on with (without one, a timeline starts at setup)."""
        self.state = state  # the run's record: config, datasets, runtime decisions, cache folders, locks
        self.config: TrainingConfig = state.config
        self.output_dir = Path(self.config.output_dir).expanduser()
        self.overwrite, self.hardware, self.peak_tflops = overwrite, hardware, peak_tflops
        self.run_log = runlog.RunLog()  # training.log + metrics.jsonl (rank 0)
        self.progress = Progress()  # the run's counters, saved in every checkpoint
        self.nonfinite = NonFinitePolicy(self.config)  # what a window that is not finite does
        self.losses: list[float] = []  # the window loss of every optimizer step this run
        self.last_logs: dict[str, float] = {}  # figures of the latest logging window
        self.validation_images: list[Path] = []
        self._preempt: RunSignals | None = None  # while the step loop runs: its signal is read at each step
        self._pending: list[torch.Tensor] = []  # window losses since the last log line
        self.startup = startup  # until the first step is reported; then None
        self._startup_figures: dict[str, object] | None = None  # the timeline, for the launch's first window

    # --- setup: the builders, in order ---------------------------------------------------
    def setup(self, locks: ExitStack | None = None) -> int | None:
        """Everything before the first step (see the class doc). ``locks`` holds the output_dir and cache
        locks until the run ends (``train()`` passes its own; without one the trainer keeps them until it is
        freed). Returns the step of a resumed run that is already finished (nothing else is built), else None."""
        if locks is None:
            locks = self._setup_locks = ExitStack()
        if self.startup is None:
            self.startup = StartupTimeline()
        clock, before = self.startup, set(self.startup.phases)
        self._setup_process()
        finished = self._claim_run(locks)
        if finished is not None:  # resumed a run already at its last step: nothing to build
            return finished
        self.accumulation, self.runtime = self._start_run(locks)
        clock.mark("accelerator")
        datasets = self._setup_data()
        clock.mark("datasets")
        self._setup_caches(datasets, locks)
        clock.mark("caches")
        denoiser = self._setup_model(self.runtime.managed_memory)
        clock.mark("model")
        self.total_steps = self._setup_sampling(datasets, denoiser)
        clock.mark("sampling")
        self._setup_optimizer(denoiser, self.total_steps)
        clock.mark("optimizer")
        if self.config.resume_from_checkpoint:
            self._resume()
            clock.mark("resume")
            # num_train_epochs: the length is known only now
            finished = run_folder.finished_step(self.output_dir, self.config.resume_from_checkpoint, self.total_steps)
        self.startup_seconds = {k: v for k, v in clock.phases.items() if k not in before}  # setup's own phases
        logger.info("start-up: %s", clock.line())
        return finished

    def _setup_process(self) -> None:
        """Process settings, ``mixed_precision`` / ``weight_dtype``, ``spec``, ``accelerator``, ``cpu_threads``
        and this rank's noise ``generator``. The allocator is set before anything touches CUDA."""
        cfg = self.config
        allocator, notes = allocator_settings(cfg, os.environ)  # managed_memory "all" adds what it needs
        knobs.apply_cuda_allocator(allocator)  # before anything touches CUDA
        for note in notes:
            logger.info("%s", note)
        self.mixed_precision = resolve_mixed_precision(cfg.mixed_precision)
        self.weight_dtype = PRECISION_DTYPES[self.mixed_precision]
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
        self.generator = noise_generator(cfg.seed, acc.process_index)

    def _claim_run(self, locks: ExitStack) -> int | None:
        """Check the launch, take ``output_dir`` (its lock goes on ``locks``), make ``run_id`` and the
        ``checkpointer``: before anything loads or is written. Returns the step of a resumed run that is
        already finished, else None."""
        cfg, acc = self.config, self.accelerator
        check_launch(acc, cfg)  # processes, FSDP, one config on every node
        self._claim_output_dir(locks)  # one output_dir, one run
        check_shared_output_dir(acc, self.output_dir)  # every node sees the folder rank 0 holds
        self.run_id, token = ckpt.start_launch(acc, self.output_dir)  # output_dir is ours: clears dead saves
        self.checkpointer = ckpt.Checkpointer(acc, self.output_dir, cfg.checkpoints_total_limit, token)
        if acc.is_main_process:  # push_to_hub: the repo was checked before anything was written (cli.train)
            remove_staging(self.output_dir)  # uploads a killed run never sent: their files are still in place
            self.uploads = RunUploads.start(
                cfg, self.output_dir, self.state.hub_model, acc.num_processes, self.state.hub_upload
            )
            if self.uploads is not None:
                locks.callback(self.uploads.abandon)  # a run that stops early names what it did not send
        return run_folder.finished_step(self.output_dir, cfg.resume_from_checkpoint, cfg.max_train_steps)

    def _start_run(self, locks: ExitStack) -> tuple[AccumulationPolicy, RuntimeDecisions]:
        """Log the settings in force, seed, decide accumulation and the GH200 runtime, and open the run's files."""
        from accelerate.utils import set_seed

        acc = self.accelerator
        self._log_settings_in_force()
        set_seed(self.config.seed)
        policy, decisions = self._configure_gh200_runtime(locks)
        if acc.is_main_process:
            run_folder.write_run_config(self.output_dir, self.state.raw_config)
        self.run_log.open(self.output_dir, acc.is_main_process)  # before the long work: the cache fill
        return policy, decisions

    def _configure_gh200_runtime(self, locks: ExitStack) -> tuple[AccumulationPolicy, RuntimeDecisions]:
        """Apply ``cache_config`` / ``gh200_optimizations``: the accumulation policy (every run, GH200 or not) and
        the runtime decisions, recorded in the StateTracker and ``<output_dir>/gh200_runtime.json``; managed
        memory ends with ``locks``."""
        acc = self.accelerator
        policy = build_accumulation(self.config, acc.num_processes)
        decisions = configure_runtime(
            self.config, acc.num_processes, acc.is_main_process, self.output_dir, accumulation=policy.state_dict()
        )
        self.state.set_gh200_runtime_config(decisions.as_record())
        # managed_memory "all" routes every allocation to the pool from here until train() ends
        locks.callback(stop_managed_memory, decisions.managed_memory)
        return policy, decisions

    def _setup_data(self) -> list[RegisteredDataset]:
        """Build and scan the datasets, recorded in the StateTracker. A stop signal here ends the run at once."""
        staging = any(d.type == "in_memory" for d in self.config.datasets or [])
        run_phase("staging" if staging else "datasets")  # SIGTERM/SIGINT: stop at once
        datasets = build_datasets(self.config, self.spec)  # the data is checked to fit the model before any scan
        for dataset in datasets:
            self.state.register_dataset(dataset)
        return datasets

    def _setup_caches(self, datasets: list[RegisteredDataset], locks: ExitStack) -> None:
        """``data`` (every latent and text embedding cached) and ``validator``. Stops first when RAM or
        GPU cannot hold the run; then every rank encodes its part of what is missing and reads the others'.
        The cache folders' locks go on ``locks``."""
        cfg, acc, spec = self.config, self.accelerator, self.spec
        run_phase("memory_check")
        check_run_memory(cfg, spec, datasets, self.weight_dtype, self.hardware, acc.num_processes)
        run_phase("cache_fill", kept=cache_entries_kept(lambda: self.state.cache_dirs))  # a stop keeps what is written
        cache_dir = Path(cfg.cache_config.cache_dir).expanduser()
        filled, encoders = fill_caches(
            spec,
            datasets,
            cache_dir,
            acc.device,
            self.weight_dtype,
            locks=locks,
            record_cache_dir=self.state.register_cache_dir,
            share=launch_share(acc),
            step=run_step,
        )
        self.data = CachedData.of(
            filled,
            CaptionDropout(cfg.seed, cfg.caption_dropout_probability),
            MaskedLoss(cfg.seed, cfg.masked_loss_probability),
        )
        self.validator = None
        if cfg.validation_prompt_list and acc.is_main_process:
            from simpletuner.training.validation import Validator  # only runs with validation prompts import it

            self.validator = Validator(spec, cfg, encoders, self.output_dir, datasets)
        del encoders
        free_memory()  # the encoders the validator does not keep

    def _setup_model(self, managed: ManagedMemoryPlan) -> torch.nn.Module:
        """The denoiser, ready to train (adapters, low_vram, compile), its weights placed as ``managed`` plans."""
        cfg, spec = self.config, self.spec
        run_phase("model_load")
        # LoRA trains fp32 adapters on a frozen base held in the autocast precision; full fine-tunes keep fp32 masters.
        denoiser = spec.load_denoiser(self.weight_dtype if cfg.training_type == "lora" else torch.float32)
        denoiser = spec.prepare_denoiser(denoiser, self.weight_dtype)
        spec.check_exports(denoiser)  # output_formats: a module a format cannot hold is named before training
        # managed_memory frozen_weights: the frozen base lives in CPU memory, prefetched block by block.
        self.weight_prefetcher = place_weights(denoiser, managed)
        if cfg.low_vram:
            spec.apply_low_vram(denoiser)
        denoiser = knobs.maybe_compile(denoiser, cfg.enable_compile)
        self._denoiser_fingerprint = denoiser_fingerprint(denoiser)
        return denoiser

    def _setup_sampling(self, datasets: list[RegisteredDataset], denoiser: torch.nn.Module) -> int:
        """``sampler`` over every training sample, the eval batches (``evaluator``) and ``flops_per_sample``;
        returns the run's optimizer steps (for epoch runs the sampler's length sets them)."""
        cfg, acc = self.config, self.accelerator
        samples = [s for ds in datasets for s in ds.samples]
        weights = {ds.id: ds.config.probability for ds in datasets}  # datasets[].probability
        self.sampler = BucketSampler(
            samples, cfg.train_batch_size, acc.num_processes, acc.process_index, cfg.seed, weights=weights
        )
        self.evaluator = None
        if cfg.eval_steps:
            from simpletuner.training.validation import EvalLoss

            self.evaluator = EvalLoss(self.spec, self.data, samples, cfg, acc)
        self.flops_per_sample = self._flops_per_sample(denoiser, samples)  # before DDP wraps it (see there)
        if cfg.max_train_steps is not None:
            return cfg.max_train_steps
        assert cfg.num_train_epochs is not None  # the config rules require one of the two
        return count_steps(self.accumulation, cfg.num_train_epochs * len(self.sampler))  # the windows the ramp makes

    def _setup_optimizer(self, denoiser: torch.nn.Module, total_steps: int) -> None:
        """``optimizer`` and ``lr_scheduler`` over ``total_steps``, ``model`` / ``optimizer`` prepared by
        Accelerate, ``trainable_params``, ``ema`` and the trackers."""
        cfg, acc = self.config, self.accelerator
        optimizer = build_optimizer(cfg, self.spec.named_parameter_groups(denoiser))
        self.lr_scheduler = build_lr_scheduler(cfg, optimizer, total_steps, acc.num_processes)
        # The schedule is not prepared: Accelerate would step it once per process per step.
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

    def eval_loss(self) -> float:
        """Mean loss over the fixed eval batches with the same noise and timesteps every time (eval_steps)."""
        assert self.evaluator is not None, "eval_loss() needs eval_steps"
        return self.evaluator(self.model)

    @property
    def eval_batches(self) -> list[Batch]:
        return self.evaluator.batches if self.evaluator is not None else []

    def _flops_per_sample(self, model: torch.nn.Module, samples: list[Sample]) -> float | None:
        """Forward + backward FLOPs per sample, counted once on a throwaway micro-batch (counting a
        real step would perturb it: see metrics.flops_per_sample) and kept in the cache folder by what
        they depend on (metrics.flops_key), so a later launch of the same model and shapes reads them.
        It runs before DDP wraps the model: a backward DDP sees (even under no_sync) marks the parameters it
        reached as used for the first real all-reduce, which with find_unused_parameters fails on a Wan 2.2
        expert that step does not reach. Skipped under torch.compile, which the counter would disturb.
        """
        cfg, acc = self.config, self.accelerator
        if cfg.enable_compile or not samples:
            return None
        sampler = BucketSampler(samples, cfg.train_batch_size, acc.num_processes, acc.process_index, cfg.seed + 2)
        batch = self.data.batch(next(iter(sampler)), acc.device)
        shapes = {"latents": batch.latents.shape, **{k: v.shape for k, v in batch.conditioning.items()}}
        key = metrics.flops_key(type(self.spec).__qualname__, model, shapes, cfg.model_dump(mode="json"))
        folder = Path(cfg.cache_config.cache_dir).expanduser()
        per_sample = metrics.remembered_flops(folder, key)
        if per_sample is not None:
            logger.info(
                "%.3g FLOPs per sample (forward + backward), counted before for this model, adapter and batch "
                "shape (%s)",
                per_sample,
                folder / metrics.FLOPS_FILE,
            )
            return per_sample
        per_sample = metrics.flops_per_sample(
            lambda m, gen: self.spec.training_loss(m, batch.latents, batch.conditioning, gen),
            model,
            batch.num_samples,
            acc,
        )
        if acc.is_main_process:
            metrics.remember_flops(folder, key, per_sample)
        logger.info("%.3g FLOPs per sample (forward + backward)", per_sample)
        return per_sample

    def _peak_tflops(self) -> float | None:
        """The peak MFU is measured against (--peak-tflops, else the GPU table's); None leaves MFU out."""
        hardware = self.hardware
        if hardware is None and self.peak_tflops is None and torch.cuda.is_available():
            hardware = detect_hardware()
        return metrics.peak_tflops_for_run(hardware, self.mixed_precision, self.config.enable_tf32, self.peak_tflops)

    def _identity(self) -> dict:
        return run_identity(self.config, self.spec, self._denoiser_fingerprint, self.state.hub_model)

    # --- checkpoints ---------------------------------------------------------------------
    def _checkpoint_parts(self) -> ckpt.CheckpointParts:
        model, acc = self.accelerator.unwrap_model(self.model), self.accelerator
        parts = (self.optimizer, self.lr_scheduler, self.generator, self.progress, self.sampler, self.accumulation)
        return ckpt.CheckpointParts(model, *parts, scaler=acc.scaler, ema=self.ema)

    def save_checkpoint(self) -> Path:
        """A resumable checkpoint of this step (collective); LoRA runs also get the adapter the final save
        writes (``spec.save_adapter``), loadable as it is. Full fine-tunes get none: ``trainable.safetensors``
        already holds the whole denoiser, and a second copy would double the checkpoint; except where the family
        asks for it (``spec.checkpoints_hold_full_weights``: a ControlNet's folder, as SimpleTuner writes it)."""
        parts = self._checkpoint_parts()
        write = None
        if self.config.training_type == "lora":
            write = lambda folder: self.spec.save_adapter(folder, parts.model)  # noqa: E731
        elif self.spec.checkpoints_hold_full_weights:
            write = lambda folder: self.spec.save_full(folder, parts.model)  # noqa: E731
        self._last_saved_path = self.checkpointer.save(
            self.progress.global_step,
            parts,
            run_id=self.run_id,
            identity=self._identity(),
            write_adapter=write,
        )
        self._last_saved_step = self.progress.global_step  # once it is complete: a failed save saved nothing
        return self._last_saved_path

    def _resume(self) -> None:
        """Continue from the checkpoint ``resume_from_checkpoint`` names, verified against its manifest
        first (a damaged ``latest`` falls back to the newest that verifies; see checkpoint.py). Every
        file is read before any state is applied, and the run adopts the checkpoint's run id."""
        assert self.config.resume_from_checkpoint  # setup() resumes only then
        path = ckpt.resolve_resume(self.output_dir, self.config.resume_from_checkpoint)
        if path is None:
            logger.info(
                "resume_from_checkpoint='latest' but %s holds no complete checkpoint: starting fresh", self.output_dir
            )
            return
        state = ckpt.restore_parts(path, self.accelerator, self._checkpoint_parts(), self._identity())
        self.run_id = state["run_id"]
        at = (self.progress.global_step, self.progress.samples_seen)
        logger.info("resumed from %s at step %d (%d samples seen; run %s)", path, *at, self.run_id)

    def _claim_output_dir(self, locks: ExitStack) -> None:
        """Lock ``output_dir`` for this run (rank 0), held on ``locks`` until the run ends with the cache locks
        the cache fill adds (simpletuner/locks.py); then refuse to write over another run's results there, or
        with ``overwrite`` remove them first (run_folder.take_output_dir)."""
        run_folder.lock_output_dir(self.accelerator, self.output_dir, locks)
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
        outcome says ``skipped``, with the ``nonfinite_policy``'s verdict. Deciding that costs one host
        sync per optimizer step (none per micro-batch); the same sync carries the preemption flag so
        every rank agrees on both. Nothing is written here: the loop acts on the outcome.
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
        bad, signum = self._agree(total, norm)
        if bad:
            self.optimizer.zero_grad(set_to_none=True)
            self.progress.skipped_steps += 1
            where = describe_window(self.progress.global_step, total, norm, micro_batches)
            stop = self.nonfinite.failed(where, self.progress.skipped_steps)
            return StepOutcome(
                total, skipped=True, num_samples=window_samples, preempt_signum=signum, nonfinite_stop=stop
            )
        self.nonfinite.passed()
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.global_step += 1
        self.progress.micro_batches_seen += len(micro_batches)
        self.progress.samples_seen += window_samples * acc.num_processes
        if self.ema is not None:  # after a real optimizer step only: a skipped window returned above
            self.ema.step(self.progress.global_step)
        return StepOutcome(total, skipped=False, num_samples=window_samples, preempt_signum=signum)

    def _agree(self, loss: torch.Tensor, norm: torch.Tensor) -> tuple[bool, int | None]:
        """Whether any rank saw a non-finite loss or gradient, and the stop signal every rank agreed on."""
        acc = self.accelerator
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm.to(loss.device)))
        signum = float(self._preempt.signum or 0) if self._preempt is not None else 0.0
        flags = torch.stack([bad.float(), torch.tensor(signum, device=loss.device)])
        if acc.num_processes > 1:
            flags = acc.reduce(flags, reduction="max")  # the one collective of the step
        any_bad, agreed_signum = flags.tolist()
        return bool(any_bad), int(agreed_signum) or None

    def _out_of_memory(self, exc: BaseException) -> OutOfMemory:
        """Free what the failed step held and explain what would fit (nothing is saved)."""
        self.optimizer.zero_grad(set_to_none=True)
        free_memory()
        from simpletuner.memory.oom import explain_out_of_memory  # the memory planner: only after an OOM

        return OutOfMemory(explain_out_of_memory(self.config, exc, num_processes=self.accelerator.num_processes))

    # --- the loop ------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Run to ``max_train_steps`` (or the epochs) and save the final weights.

        On rank 0 the log lines also go to ``output_dir/training.log`` and each logging window to
        ``output_dir/metrics.jsonl`` (both appended to across resumes); the lines logged before
        setup knows the output folder are held until it does.
        """
        with self.run_log, ExitStack() as locks:  # output_dir and cache locks, the end of managed memory
            return self._train(locks)

    def _train(self, locks: ExitStack) -> TrainResult:
        # SIGTERM / SIGINT for the whole run; what one does depends on the phase (reliability.RunSignals):
        # stop at once outside the loop, save at the step boundary inside it, finish the final save first.
        with RunSignals() as signals:
            finished_at = self.setup(locks)
            acc = self.accelerator
            if finished_at is not None:  # resumed a run already at max_train_steps: nothing trained, nothing saved
                acc.end_training()
                return TrainResult(finished_at)
            if self.progress.global_step == 0 and self.config.validation_prompt_list:
                run_phase("first_validation")
                self._validate()
                if self.startup is not None:
                    self.startup.mark("first_validation")
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
            if self.uploads is not None:
                run_phase("upload")
                self.uploads.final()
            run_phase("done")
            acc.end_training()
            return TrainResult(self.progress.global_step, self.losses, output, self.validation_images)

    def _loop(self, batches: Iterator[Batch], bar, meter: metrics.ThroughputWindow) -> None:
        while self.progress.global_step < self.total_steps:
            outcome = self.run_window(batches, meter)
            if outcome.nonfinite_stop is not None:  # nonfinite_policy: save the last good state and stop
                raise outcome.nonfinite_stop.error(self.save_checkpoint())
            if not outcome.skipped:
                self._after_step(outcome, bar, meter)
            self._stop_if_preempted(outcome.preempt_signum)

    def _after_step(self, outcome: StepOutcome, bar, meter: metrics.ThroughputWindow) -> None:
        """What the cadence asks for after optimizer step ``progress.global_step``."""
        step = self.progress.global_step
        if self.startup is not None:
            self._report_startup()
        self._pending.append(outcome.loss)
        meter.step_done(outcome.num_samples)
        bar.update(1)
        if self._should_log(step):
            self._log_window(step, bar, meter)
        saved = self.save_checkpoint() if self._should_checkpoint(step) else None
        if self._should_validate(step):
            self._validate()
        if saved is not None and self.uploads is not None:  # after validation: the card shows this step's images
            self.uploads.checkpoint(saved, step)

    def _report_startup(self) -> None:
        """After this launch's first optimizer step: the start-up timeline in training.log, and in the launch's
        first logging window of metrics.jsonl."""
        assert self.startup is not None
        timeline, self.startup = self.startup, None
        timeline.mark("first_step")
        origin = "the command" if INTERPRETER in timeline.phases else "setup"
        logger.info("first step done %.2fs after %s: %s", timeline.total, origin, timeline.line())
        self._startup_figures = {"startup_s": timeline.record(), "to_first_step_s": round(timeline.total, 3)}

    # --- cadence -------------------------------------------------------------------------
    def _should_log(self, step: int) -> bool:
        return step % self.config.logging_steps == 0 or step == self.total_steps

    def _should_checkpoint(self, step: int) -> bool:
        every = self.config.checkpointing_steps
        return step % every == 0 if every else False

    def _should_validate(self, step: int) -> bool:
        """Whether the loop validates after ``step`` (rank 0 renders, when there are prompts)."""
        every = self.config.validation_steps
        return step % every == 0 if every else False

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
        self.run_log.write_metrics(step, logs, self._startup_figures)
        self._startup_figures = None
        logger.info("step %d/%d %s", step, self.total_steps, metrics.log_line(logs))
        self._pending = []

    def _validate(self) -> None:
        if self.validator is None:  # not rank 0, or no validation prompts
            return
        model = self.accelerator.unwrap_model(self.model)
        self.validation_images += self.validator.render(
            model, self.progress.global_step, self.accelerator, ema=self.ema
        )

    def _stop_if_preempted(self, signum: int | None) -> None:
        """At a step boundary where every rank agreed on a stop signal: save and stop with its exit code."""
        if signum is None:
            return
        if self._last_saved_step == self.progress.global_step:  # this step is saved already
            path = self._last_saved_path
        else:
            path = self.save_checkpoint()
        raise Preempted(signum, path, self.state.resume_command)

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
