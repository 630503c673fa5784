"""An ai-toolkit job file (one trainer process) -> a native config with the same meaning, and the report of what each
key became. The keys and what each becomes: :mod:`.table`; ai-toolkit's defaults and names: :mod:`.facts`; how the
translation keeps the meaning: documentation/MIGRATING_FROM_AI_TOOLKIT.md (generated from the table).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from simpletuner.configuration.aitoolkit.facts import (
    ARCH_SWITCHES,
    ARCHES,
    DTYPES,
    EPS_1E6,
    FLOW_FAMILIES,
    OPTIMIZER_DIFFERENCES,
    OPTIMIZERS,
    QTYPES,
    TRAINER_PROCESSES,
)
from simpletuner.configuration.aitoolkit.reading import looks_like_ai_toolkit, with_name_filled
from simpletuner.configuration.aitoolkit.table import Section, is_tail_inert, row_for
from simpletuner.configuration.simpletuner.reading import DialectError, Problem, Report, as_bool, as_number, plain

__all__ = ["DialectError", "looks_like_ai_toolkit", "translate", "AitReport"]


@dataclass
class AitReport(Report):
    """What the translation did, key by key (logged at start, printed by ``convert``)."""

    def lines(self, mapped: bool = True) -> list[str]:
        out = super().lines(mapped)
        out[0] = (
            f"read as an ai-toolkit job: {len(self.mapped)} keys mapped, {len(self.approximated)} approximated, "
            f"{len(self.ignored)} ignored, {len(self.defaults)} ai-toolkit defaults applied"
        )
        return out


@dataclass
class Job:
    """The native config being written from one trainer process, and the report."""

    cwd: Path
    out: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    report: AitReport = field(default_factory=AitReport)
    family: Optional[str] = None

    def put(self, ours: str, value: Any, source: str, target: Optional[dict] = None) -> None:
        node = self.out if target is None else target
        parts = ours.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        self.report.mapped.append(f"`{source}` -> `{ours}`")

    def default(self, ours: str, value: Any, what: str) -> None:
        """ai-toolkit's default for what the job leaves out, where ours differs."""
        if ours not in self.out:
            self.out[ours] = value
            self.report.defaults.append(f"`{what}: {value!r}` -> `{ours}` (ai-toolkit's default)")

    def path(self, value: Any) -> Any:
        """A path as ai-toolkit opens it, from the working directory (it rebases no path on the job file's folder:
        toolkit/config.py:14-17 resolves only the job file's own path), made absolute."""
        if not isinstance(value, str) or not value:
            return value
        expanded = os.path.expanduser(value)
        return expanded if os.path.isabs(expanded) else os.path.normpath(os.path.join(self.cwd, expanded))

    def approx(self, key: str, message: str) -> None:
        self.report.approximated.append(f"`{key}`: {message}")

    def ignore(self, key: str, why: str) -> None:
        self.report.ignored.append(f"`{key}` ({why})")

    def stop(self, key: str, message: str) -> None:
        self.problems.append(f"`{key}`: {message}")


def _note(section: Section, key: str) -> str:
    """The table's note on ``key`` (its warning, where approximated)."""
    row = row_for(section, key)
    assert row is not None, (section, key)
    return row.note


def _number(job: Job, value: Any, where: str) -> Any:
    try:
        return as_number(value, where)
    except Problem as exc:
        job.problems.append(str(exc))
        return None


def _bool(job: Job, value: Any, where: str) -> Optional[bool]:
    try:
        return as_bool(value, where)
    except Problem as exc:
        job.problems.append(str(exc))
        return None


# --- the job's shape ------------------------------------------------------------------------------------------------


def _the_process(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The one trainer process of the job, or DialectError saying why it is not one."""
    job = raw.get("job")
    config = raw.get("config")
    if job != "extension":
        why = "no `job` key" if job is None else f"`job: {job}`"
        raise DialectError(
            [
                f"{why}: only ai-toolkit's `job: extension` with a trainer process (`type: sd_trainer`) trains "
                "here; extract / generate / mod jobs and the legacy `train` jobs do not"
            ]
        )
    processes = config.get("process") if isinstance(config, dict) else None
    if not isinstance(processes, list) or not processes:
        raise DialectError(["`config.process` must be a list holding one trainer process (`type: sd_trainer`)"])
    if len(processes) > 1:
        kinds = ", ".join(repr(p.get("type")) if isinstance(p, dict) else "?" for p in processes)
        raise DialectError(
            [
                f"`config.process` holds {len(processes)} processes ({kinds}): one run trains one process here; "
                "split them into one job file each"
            ]
        )
    process = processes[0]
    if not isinstance(process, dict):
        raise DialectError(["`config.process[0]` must be a mapping of the process's keys"])
    if process.get("type") not in TRAINER_PROCESSES:
        raise DialectError(
            [
                f"`config.process[0].type: {process.get('type')}`: not a trainer process trained here (those are "
                f"{', '.join(TRAINER_PROCESSES)}); sliders, textual inversion, generators and tools have no "
                "counterpart"
            ]
        )
    return process


# --- one key, by its row ---------------------------------------------------------------------------------------------


def _generic(job: Job, section: Section, key: str, value: Any, shown: str, target: Optional[dict] = None) -> bool:
    """A key whose row needs no code of its own: renamed, ignored, or stopped. False where the row is special."""
    row = row_for(section, key)
    if row is None:
        if section in ("process", "job"):
            if not is_tail_inert(section, key, value):
                job.stop(shown, "not a key of ai-toolkit's trainer process that is trained here: remove it")
            else:
                job.ignore(shown, "empty")
        else:
            job.approx(shown, "not a key ai-toolkit reads here (a misspelling?): it has no effect there or here")
        return True
    if row.special:
        return False
    if row.kind == "ignored":
        job.ignore(shown, row.note)
    elif row.kind == "unsupported":
        if is_tail_inert(section, key, value):
            job.ignore(shown, f"set to {value!r}, which does nothing")
        else:
            job.stop(shown, f"{value!r}: {row.note}")
    elif row.ours is None:  # nothing to write: what it does here is said
        job.report.mapped.append(f"`{shown}` (no key of its own here)")
    else:
        job.put(row.ours, plain(value), shown, target)
    if row.kind == "approximated" and value not in (None, False):
        job.approx(shown, row.note)
    return True


def _section(job: Job, process: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = process.get(name, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        job.stop(name, "must be a mapping of keys")
        return {}
    return value


# --- model --------------------------------------------------------------------------------------------------------


def _model(job: Job, model: dict[str, Any]) -> None:  # noqa: C901, PLR0915
    name = model.get("name_or_path")
    if not isinstance(name, str) or not name:
        job.stop("model.name_or_path", "must name the model (a diffusers folder or hub id), as ai-toolkit requires")
    else:
        local = job.path(name)
        job.put("pretrained_model_name_or_path", local if os.path.exists(local) else name, "model.name_or_path")
    arch = model.get("arch")
    if isinstance(arch, str) and ":" in arch:  # the UI's `arch:tag` (config_modules.py:764-768)
        arch = arch.split(":")[0]
    if arch is None:
        arch = next((a for switch, a in ARCH_SWITCHES.items() if model.get(switch) is True), "sd1")
        where = "model." + next((s for s, a in ARCH_SWITCHES.items() if model.get(s) is True), "arch (unset: sd1)")
    else:
        where = "model.arch"
    family = ARCHES.get(str(arch))
    if family is None:
        known = ", ".join(a for a, f in ARCHES.items() if f is not None)
        job.stop(where, f"{arch!r} is not an architecture trained here (those are: {known})")
    else:
        job.family = family
        job.put("model_family", family, where)
    for switch in ARCH_SWITCHES:
        if switch in model and f"model.{switch}" != where:
            job.ignore(f"model.{switch}", "`arch` decides the architecture" if where == "model.arch" else "false")
    _quantize(job, model)
    kwargs = model.get("model_kwargs") or {}
    if isinstance(kwargs, dict) and kwargs:
        high = kwargs.get("train_high_noise", True)
        low = kwargs.get("train_low_noise", True)
        for key in kwargs:
            if key not in ("train_high_noise", "train_low_noise"):
                job.stop(f"model.model_kwargs.{key}", "not trained here: remove it")
        if not (high or low):
            job.stop("model.model_kwargs", "at least one of train_high_noise / train_low_noise must be true")
        elif arch != "wan22_14b" and arch != "wan22_14b_i2v":
            job.ignore("model.model_kwargs", "only Wan 2.2 14B reads train_high_noise / train_low_noise")
        else:
            job.put("train_stages", "both" if high and low else "high" if high else "low", "model.model_kwargs")
    if model.get("is_v_pred") is True:
        job.put("prediction_type", "v_prediction", "model.is_v_pred")
    extras = model.get("extras_name_or_path")
    if extras is not None and extras != name:
        job.stop("model.extras_name_or_path", "text encoders and VAE come from `name_or_path` here: remove it")
    handled = {"name_or_path", "arch", "quantize", "qtype", "model_kwargs", "is_v_pred", "extras_name_or_path"}
    for key, value in model.items():
        if key not in handled and key not in ARCH_SWITCHES:
            _generic(job, "model", key, value, f"model.{key}")


def _quantize(job: Job, model: dict[str, Any]) -> None:
    if not model.get("quantize"):
        if "qtype" in model:
            job.ignore("model.qtype", "`quantize` is off")
        return
    qtype = str(model.get("qtype", "qfloat8"))
    if "|" in qtype:
        job.stop(
            "model.qtype",
            f"{qtype!r} uses an accuracy-recovery adapter, which is not trained with here: write `qtype: qfloat8` "
            "(8 bits) or `qint4`, or turn `quantize` off",
        )
        return
    ours = QTYPES.get(qtype)
    if ours is None:
        job.stop("model.qtype", f"{qtype!r} is not a quantisation here (those are: {', '.join(QTYPES)})")
        return
    job.put("base_model_precision", ours, "model.quantize")
    torchao = " (torchao's float8 weight-only there, quantize.py:42-49)" if qtype == "float8" else ""
    job.approx("model.quantize", f"{qtype}{torchao} -> `base_model_precision: {ours}` through optimum-quanto")


# --- network ------------------------------------------------------------------------------------------------------


def _network(job: Job, network: dict[str, Any]) -> None:  # noqa: C901
    kind = str(network.get("type", "lora")).lower()
    if kind == "lora":
        job.put("lora_type", "standard", "network.type")
    elif kind in ("lokr", "locon"):
        job.put("lora_type", "lycoris", "network.type")
        job.put("lycoris.algo", kind, "network.type")
        if kind == "lokr":
            factor = int(_number(job, network.get("lokr_factor", -1), "lokr_factor") or -1)
            job.put("lycoris.factor", factor, "network.lokr_factor")
            if factor > 0:
                job.approx("network.lokr_factor", _note("network", "lokr_factor").split("; ", 1)[-1])
            full = network.get("lokr_full_rank", True)
            job.put("lycoris.full_matrix", bool(full), "network.lokr_full_rank")
    else:
        job.stop("network.type", f"{kind!r}: only `lora`, `lokr` and `locon` train here")
    job.approx("network.type", _note("network", "type").split("; ", 2)[-1])
    # `rank` wins over `linear` where both are written (config_modules.py:172-179)
    rank = network["rank"] if network.get("rank") is not None else network.get("linear")
    if rank is None:
        job.default("lora_rank", 4, "network.linear")
    elif (number := _number(job, rank, "network.linear")) is not None:
        job.put("lora_rank", int(number), "network.linear")
    alpha = network.get("linear_alpha", network.get("alpha"))
    if alpha is None:
        job.default("lora_alpha", 1.0, "network.linear_alpha")
    elif (number := _number(job, alpha, "network.linear_alpha")) is not None:
        job.put("lora_alpha", float(number), "network.linear_alpha")
    for key in ("conv", "conv_alpha"):
        if network.get(key):
            job.stop(f"network.{key}", "convolution adapters are not trained here: remove it")
    handled = {"type", "linear", "rank", "linear_alpha", "alpha", "lokr_factor", "lokr_full_rank", "conv", "conv_alpha"}
    for key, value in network.items():
        if key not in handled:
            if key == "network_kwargs" and value:
                job.stop("network.network_kwargs", "layer filters are written as `lora_target_modules` here")
            elif key != "network_kwargs":
                _generic(job, "network", key, value, f"network.{key}")


# --- save ---------------------------------------------------------------------------------------------------------


def _save(job: Job, save: dict[str, Any]) -> None:
    every = save.get("save_every", 1000)
    if (number := _number(job, every, "save.save_every")) is not None:
        job.put("checkpointing_steps", int(number), "save.save_every")
        job.approx("save.save_every", _note("save", "save_every").rsplit(". ", 1)[0])
    keep = save.get("max_step_saves_to_keep", 5)
    if (number := _number(job, keep, "save.max_step_saves_to_keep")) is not None:
        job.put("checkpoints_total_limit", int(number), "save.max_step_saves_to_keep")
    if save.get("save_format", "safetensors") != "safetensors":
        job.stop("save.save_format", "adapters are saved as safetensors here; a whole diffusers pipeline is not")
    if save.get("push_to_hub"):
        job.default("model_card_private", bool(save.get("hf_private", False)), "save.hf_private")
    handled = {"save_every", "max_step_saves_to_keep", "save_format", "hf_private"}
    for key, value in save.items():
        if key not in handled:
            _generic(job, "save", key, value, f"save.{key}")


# --- train --------------------------------------------------------------------------------------------------------

#: ai-toolkit's timestep types that draw sigma here as they do there, for flow families
#: (custom_flowmatch_sampler.py:116-133, BaseSDTrainProcess.py:1195-1225 and 1301-1318): ours (timestep_sampling,
#: logit_std).
_SAME_TIMESTEPS = {"linear": ("uniform", None), "sigmoid": ("logit_normal", 1.0)}


def _timesteps(job: Job, train: dict[str, Any]) -> None:
    kind = str(train.get("timestep_type", "sigmoid"))
    if train.get("linear_timesteps") or train.get("linear_timesteps2"):
        kind = "linear"
    style = str(train.get("content_or_style", "balanced"))
    if style != "balanced":
        job.stop("train.content_or_style", f"{style!r} (cubic timestep sampling) is not trained here: use `balanced`")
    if job.family not in FLOW_FAMILIES:
        if "timestep_type" in train:
            job.ignore("train.timestep_type", "ai-toolkit reads it only with the flowmatch scheduler")
        return
    if kind in _SAME_TIMESTEPS:
        sampling, std = _SAME_TIMESTEPS[kind]
        job.put("timestep_sampling", sampling, f"train.timestep_type: {kind}")
        if std is not None:
            job.put("logit_mean", 0.0, f"train.timestep_type: {kind}")
            job.put("logit_std", std, f"train.timestep_type: {kind}")
        job.put("flow_shift", 1.0, f"train.timestep_type: {kind}")
        if "timestep_type" not in train:
            job.report.defaults.append("`train.timestep_type: 'sigmoid'` (ai-toolkit's default)")
    elif kind in ("shift", "flux_shift", "lumina2_shift"):
        job.put("timestep_sampling", "uniform", f"train.timestep_type: {kind}")
        job.approx(
            f"train.timestep_type: {kind}",
            "sigma uniform, shifted by the model scheduler's `shift` here; ai-toolkit shifts by the image's size "
            "where the scheduler has dynamic shifting (custom_flowmatch_sampler.py:143-161)",
        )
    else:
        job.stop(
            "train.timestep_type",
            f"{kind!r} is not a timestep draw trained here (`weighted` also weights the loss by timestep): use "
            "`linear` (the same timesteps, unweighted) or `sigmoid`",
        )


def _optimizer(job: Job, name: Any, params: Mapping[str, Any], where: str) -> None:  # noqa: C901
    lowered = str(name).lower()
    ours = OPTIMIZERS.get(lowered)
    if ours is None:
        job.stop(where, f"{name!r} is not an optimizer here (ai-toolkit names that work: {', '.join(OPTIMIZERS)})")
        return
    job.put("optimizer", ours, where)
    if lowered in EPS_1E6:
        job.put("adam_epsilon", 1e-6, f"{where} (ai-toolkit passes eps=1e-6)")
    if name == "adafactor":  # SDTrainer.py:2278 compares the name as written: no gradient clipping with it there
        job.put("max_grad_norm", None, f"{where}: adafactor (ai-toolkit clips no gradient with it)")
    if lowered in ("adam", "automagic", "prodigy"):  # torch Adam, Automagic, Prodigy: weight decay 0 by default
        job.default("weight_decay", 0.0, f"{where} weight_decay")
    elif lowered in ("adamw", "adamw8bit"):  # torch AdamW and bitsandbytes AdamW8bit: 0.01
        job.default("weight_decay", 0.01, f"{where} weight_decay")
    if lowered == "automagic":
        job.approx(where, OPTIMIZER_DIFFERENCES["automagic"])
    elif lowered in OPTIMIZER_DIFFERENCES:
        job.approx(where, OPTIMIZER_DIFFERENCES[lowered])
    extra: dict[str, Any] = {}
    for key, value in params.items():
        shown = f"{where.rsplit('.', 1)[0]}.optimizer_params.{key}" if where == "train.optimizer" else f"{where}.{key}"
        number = plain(value)
        if key == "weight_decay":
            job.put("weight_decay", number, shown)
        elif key == "eps" and lowered in EPS_1E6:
            job.out["adam_epsilon"] = number
        elif key == "betas" and isinstance(value, list) and len(value) == 2:
            job.put("adam_beta1", plain(value[0]), shown)
            job.put("adam_beta2", plain(value[1]), shown)
        elif lowered == "automagic" and key in ("lr_bump", "min_lr", "max_lr"):
            job.put(key, number, shown)
        elif key.startswith(("high_noise_", "low_noise_")):  # the GH200 fork's per-expert bounds (seed 001, 6.1)
            job.put(key, number, shown)
        else:
            extra[key] = number
    if extra:
        job.put("optimizer_config", extra, f"{where} params")
    _start_rate(job, lowered, where)


def _start_rate(job: Job, lowered: str, where: str) -> None:
    """The learning rate ai-toolkit's optimizer actually starts from, where it is not the job's ``lr``."""
    rate = job.out.get("learning_rate")
    if not isinstance(rate, float):
        return
    if lowered == "prodigy" and rate < 0.1:  # optimizer.py:46-49
        job.put("learning_rate", 1.0, f"{where}: prodigy (ai-toolkit runs Prodigy at lr 1.0 below 0.1)")
    if lowered != "automagic":
        return
    floor = job.out.get("min_lr", 1e-7)
    if rate > 1e-3:  # automagic.py:24-26
        job.put("learning_rate", 1e-6, f"{where}: automagic (ai-toolkit's Automagic starts at 1e-6 above 1e-3)")
    elif isinstance(floor, float) and rate < floor:
        job.put("learning_rate", floor, f"{where}: automagic")
        job.approx(
            "train.lr",
            f"{rate:g} is below Automagic's min_lr {floor:g}: ai-toolkit clamps every rate into [min_lr, max_lr] "
            "at the first step (automagic.py:262-266), so it starts at min_lr here",
        )


def _train(job: Job, train: dict[str, Any], fork_optimizer: Optional[dict[str, Any]]) -> None:  # noqa: C901, PLR0915
    steps = train.get("steps", 1000)
    if (number := _number(job, steps, "train.steps")) is not None:
        job.put("max_train_steps", int(number), "train.steps")
    lr = train.get("unet_lr", train.get("lr", 1e-6))
    if (number := _number(job, lr, "train.lr")) is not None:
        job.put("learning_rate", float(number), "train.lr")
    if "text_encoder_lr" in train and train.get("train_text_encoder"):
        job.put("text_encoder_lr", plain(train["text_encoder_lr"]), "train.text_encoder_lr")
    params = train.get("optimizer_params") or {}
    name = train.get("optimizer", "adamw")
    if fork_optimizer is not None:
        if "optimizer" in train:
            job.stop("optimizer", "the job also sets `train.optimizer`: keep one of them")
        fork = dict(fork_optimizer)
        name = fork.pop("name", "adamw")
        params = {**params, **fork}
        _optimizer(job, name, params, "optimizer")
    else:
        _optimizer(job, name, params if isinstance(params, dict) else {}, "train.optimizer")
    schedule = str(train.get("lr_scheduler", "constant"))
    if schedule == "cosine" and job.out.get("optimizer") == "automagic":
        job.put("lr_scheduler", "constant", "train.lr_scheduler")
        job.approx(
            "train.lr_scheduler",
            "`cosine` does nothing to ai-toolkit's Automagic, which steps with its own per-element rates "
            "(automagic.py:252-258) and never reads the scheduled lr: `constant` here (ours would follow it)",
        )
    elif schedule in ("constant", "cosine"):
        job.put("lr_scheduler", schedule, "train.lr_scheduler")
        if schedule == "cosine":
            job.approx("train.lr_scheduler", "cosine decay to 0 over the run (torch's CosineAnnealingLR there)")
    else:
        job.stop("train.lr_scheduler", f"{schedule!r}: `constant` and `cosine` are read here")
    if train.get("lr_scheduler_params"):
        job.stop("train.lr_scheduler_params", "the schedule's parameters are not read here: remove them")
    accumulation = train.get("gradient_accumulation", train.get("gradient_accumulation_steps", 1))
    if (number := _number(job, accumulation, "train.gradient_accumulation")) is not None:
        if number < 1:
            job.stop("train.gradient_accumulation_steps", "-1 (a whole epoch) is not read here: give a number")
        else:
            job.put("gradient_accumulation_steps", int(number), "train.gradient_accumulation")
            if number > 1 and "gradient_accumulation" not in train:
                job.approx("train.gradient_accumulation_steps", _note("train", "gradient_accumulation_steps"))
    checkpointing = train.get("gradient_checkpointing", True)
    job.put("gradient_checkpointing", bool(checkpointing), "train.gradient_checkpointing")
    _precision(job, train)
    _timesteps(job, train)
    scheduler = str(train.get("noise_scheduler", "ddpm"))
    wanted = "flowmatch" if job.family in FLOW_FAMILIES else "ddpm"
    if job.family is not None and scheduler != wanted and not (wanted == "ddpm" and scheduler in ("ddpm", "euler")):
        job.stop("train.noise_scheduler", f"{scheduler!r}: this family trains with {wanted!r} here")
    _train_switches(job, train)
    if "max_grad_norm" in train and name == "adafactor":
        train = {k: v for k, v in train.items() if k != "max_grad_norm"}
        job.ignore("train.max_grad_norm", "ai-toolkit clips no gradient with adafactor (SDTrainer.py:2278)")
    handled = {
        "steps", "lr", "unet_lr", "text_encoder_lr", "optimizer", "optimizer_params", "lr_scheduler",
        "lr_scheduler_params", "gradient_accumulation", "gradient_accumulation_steps", "gradient_checkpointing",
        "dtype", "mixed_precision", "timestep_type", "linear_timesteps", "linear_timesteps2", "content_or_style",
        "noise_scheduler", "train_unet", "ema_config", "noise_offset", "min_snr_gamma", "snr_gamma", "loss_type",
        "skip_first_sample", "disable_sampling", "cache_text_embeddings", "unload_text_encoder",
        "switch_boundary_every",
    }  # fmt: skip
    for key, value in train.items():
        if key not in handled:
            _generic(job, "train", key, value, f"train.{key}")


def _precision(job: Job, train: dict[str, Any]) -> None:
    if "mixed_precision" in train:  # the GH200 fork's spelling (seed 001, 10.3)
        value = str(train["mixed_precision"])
        ours = {"fp16": "fp16", "bf16": "bf16", "no": "no", "fp32": "no"}.get(value)
        if ours is None:
            job.stop("train.mixed_precision", f"{value!r}: one of fp16, bf16, no")
        elif "dtype" in train and DTYPES.get(str(train["dtype"])) != ours:
            job.stop("train.mixed_precision", f"and `train.dtype: {train['dtype']}` disagree: keep one")
        else:
            job.put("mixed_precision", ours, "train.mixed_precision")
        return
    dtype = str(train.get("dtype", "fp32"))
    ours = DTYPES.get(dtype)
    if ours is None:
        job.stop("train.dtype", f"{dtype!r}: one of {', '.join(DTYPES)}")
        return
    job.put("mixed_precision", ours, "train.dtype")
    if "dtype" in train and ours != "no":
        job.approx("train.dtype", _note("train", "dtype").split(". ")[0])


def _train_switches(job: Job, train: dict[str, Any]) -> None:  # noqa: C901
    if train.get("train_unet", True) is not True:
        job.stop("train.train_unet", "the denoiser always trains here: remove it")
    ema = train.get("ema_config")
    if isinstance(ema, dict) and ema.get("use_ema"):
        job.put("use_ema", True, "train.ema_config.use_ema")
        job.put("ema_decay", float(plain(ema.get("ema_decay", 0.999))), "train.ema_config.ema_decay")
        job.put("ema_warmup_steps", 1, "train.ema_config")
        job.approx("train.ema_config", "the EMA is updated on CPU here (`ema_device`)")
        for key in ema:
            if key not in ("use_ema", "ema_decay") and ema[key] not in (False, 1.0):
                job.stop(f"train.ema_config.{key}", "not trained here: remove it")
    offset = plain(train.get("noise_offset", 0.0))
    if offset:
        job.put("noise_offset", offset, "train.noise_offset")
        job.put("noise_offset_probability", 1.0, "train.noise_offset")
    gamma = train.get("min_snr_gamma", train.get("snr_gamma"))
    if gamma is not None:
        job.put("loss_weighting", "min_snr", "train.min_snr_gamma")
        job.put("snr_gamma", plain(gamma), "train.min_snr_gamma")
        job.approx("train.min_snr_gamma", "Min-SNR-gamma weighting here (`loss_weighting: min_snr`)")
    loss = str(train.get("loss_type", "mse"))
    if loss == "mse":
        job.put("loss_type", "l2", "train.loss_type")
    elif loss == "pseudo_huber":
        job.put("loss_type", "huber", "train.loss_type")
        job.approx("train.loss_type", "pseudo-Huber with `huber_c` 0.1 on the `snr` schedule here")
    else:
        job.stop("train.loss_type", f"{loss!r}: `mse` or `pseudo_huber` train here")
    if train.get("skip_first_sample"):
        job.approx("train.skip_first_sample", _note("train", "skip_first_sample"))
    caching_text = bool(train.get("cache_text_embeddings"))
    if train.get("unload_text_encoder") and not caching_text:  # cached embeddings: the captions (SDTrainer.py:1673)
        job.out["__trigger_only__"] = True
        job.approx("train.unload_text_encoder", _note("train", "unload_text_encoder"))
    if train.get("cache_text_embeddings"):
        job.ignore("train.cache_text_embeddings", "text embeddings are always cached here")
    if "switch_boundary_every" in train:
        job.approx("train.switch_boundary_every", _note("train", "switch_boundary_every"))


# --- sample -------------------------------------------------------------------------------------------------------


#: The per-prompt flags ai-toolkit reads from a prompt's text (config_modules.py:1396-1455); others it drops.
PROMPT_FLAGS = frozenset(
    "p2 n n2 w h d seed l cfg s steps m network_multiplier gr a ref ev extra_values frames num_frames fps ctrl_img "
    "ctrl_idx".split()
)


def _prompt(job: Job, text: str, where: str) -> tuple[str, Optional[str]]:
    """A sample prompt as ai-toolkit reads it (config_modules.py:1396-1455): the text before the first ``--``, then
    ``--flag value`` pairs. ``--ctrl_img`` is returned (the image the edit renders from); the other flags set one
    prompt's size, seed, guidance... which is not read here, so they stop; flags ai-toolkit does not know it drops."""
    text, *flags = text.strip().split("--")
    image = None
    for flag in flags:
        name = flag.split(" ")[0].strip()
        value = flag[len(name) :].strip()
        if name == "ctrl_img":
            image = job.path(value)
        elif name in PROMPT_FLAGS:
            job.stop(f"{where} --{name}", "per-prompt settings are not read here: set it in `sample` for every prompt")
        else:
            job.ignore(f"{where} --{name}", "not a flag ai-toolkit reads (it drops it too)")
    return text.strip(), image


def _sample_prompts(job: Job, sample: dict[str, Any]) -> tuple[list[str], list[Optional[str]]]:
    """The sample prompts (``prompts`` then ``samples``) and each one's control image."""
    prompts: list[str] = []
    images: list[Optional[str]] = []
    for i, text in enumerate(sample.get("prompts") or []):
        prompt, image = _prompt(job, str(text), f"sample.prompts[{i}]")
        prompts.append(prompt)
        images.append(image)
    for i, item in enumerate(sample.get("samples") or []):
        if not (isinstance(item, dict) and isinstance(item.get("prompt"), str)):
            job.stop(f"sample.samples[{i}]", "must be a mapping with a `prompt`")
            continue
        prompt, image = _prompt(job, item["prompt"], f"sample.samples[{i}].prompt")
        for key in item:  # ctrl_img_1 is ctrl_img where only one is given (config_modules.py:60-65)
            if key in ("ctrl_img", "ctrl_img_1") and isinstance(item[key], str):
                image = job.path(item[key])
            elif key != "prompt":
                job.stop(f"sample.samples[{i}].{key}", "per-prompt settings are not read here: remove it")
        prompts.append(prompt)
        images.append(image)
    return prompts, images


def _rendered_frames(frames: int, low_vram: bool) -> int:
    """The frames a Wan sample of ``frames`` has in ai-toolkit: diffusers' WanPipeline.__call__ floors the count
    to 4k+1 (40 -> 41; diffusers 0.42.1, pipeline_wan.py lines 494-498); with `low_vram` ai-toolkit samples through
    its own AggressiveWanUnloadPipeline (wan21.py:497-498), which skips that rounding, and the latents hold
    (frames - 1) // 4 + 1 frames (prepare_latents, line 341 there: 40 -> 37)."""
    if frames % 4 == 1:
        return frames
    return (frames - 1) // 4 * 4 + 1 if low_vram else frames // 4 * 4 + 1


def _sample(  # noqa: C901
    job: Job, sample: dict[str, Any], disabled: bool, trigger: Optional[str], low_vram: bool = False
) -> None:
    prompts, images = _sample_prompts(job, sample)
    if disabled or not prompts:
        if sample:
            job.ignore("sample", "sampling is disabled" if disabled else "no prompts")
        return
    if trigger:
        prompts = [p.replace("[trigger]", trigger) for p in prompts]
    job.put("validation_prompts", prompts, "sample.prompts")
    given = [image for image in images if image is not None]
    if given and len(given) < len(images):
        job.stop("sample", "some prompts have a control image (`ctrl_img`) and some do not: give every prompt one")
    elif given:
        same = len(set(given)) == 1
        job.put("validation_image", given[0] if same else given, "sample ctrl_img")
    values = {
        "validation_steps": ("sample_every", 100),
        "validation_num_inference_steps": ("sample_steps", 20),
        "validation_guidance_scale": ("guidance_scale", 7),
        "validation_seed": ("seed", 0),
        "validation_guidance_rescale": ("guidance_rescale", 0.0),
    }
    for ours, (key, default) in values.items():
        job.put(ours, plain(sample.get(key, default)), f"sample.{key}")
    width, height = sample.get("width", 512), sample.get("height", 512)
    job.put("validation_resolution", f"{int(plain(width))}x{int(plain(height))}", "sample.width / height")
    neg = sample.get("neg")
    if isinstance(neg, str) and neg:
        job.put("validation_negative_prompt", neg, "sample.neg")
    frames = int(plain(sample.get("num_frames", 1)))
    if frames > 1:
        rendered = _rendered_frames(frames, low_vram)
        said = (
            "sample.num_frames" if rendered == frames else f"sample.num_frames {frames} (ai-toolkit renders {rendered})"
        )
        job.put("validation_num_video_frames", rendered, said)
    handled = {"prompts", "samples", "neg", "width", "height", "num_frames", *(k for k, _ in values.values())}
    for key, value in sample.items():
        if key not in handled:
            _generic(job, "sample", key, value, f"sample.{key}")


# --- the translation -------------------------------------------------------------------------------------------------


def translate(
    raw: Mapping[str, Any], config_path: Optional[Path] = None, cwd: Optional[Path] = None
) -> tuple[dict[str, Any], AitReport]:
    """ai-toolkit job ``raw`` -> (native config, report). Raises DialectError listing every key that is unsupported
    or unreadable."""
    from simpletuner.configuration.aitoolkit.datasets import datasets

    source = str(config_path) if config_path else None
    try:
        raw = with_name_filled(dict(raw))
        process = _the_process(raw)
    except DialectError as exc:
        raise DialectError(exc.problems, source) from None
    job = Job(cwd=Path(cwd or os.getcwd()))
    config = raw["config"]
    for key in raw:
        if key not in ("job", "config", "meta"):
            job.stop(key, "not a key of an ai-toolkit job (job, config, meta)")
    name = config.get("name")
    # The run's folder is training_folder/<the process's name, else the job's> (BaseProcess.py:21,
    # BaseTrainProcess.py:45); the job's name names the saved files and the run.
    folder_name = process.get("name", name)
    folder = job.path(process.get("training_folder", "output"))
    named = "training_folder + name" if "name" in process else "training_folder + config.name"
    job.put("output_dir", os.path.join(folder, str(folder_name)) if folder_name else folder, named)
    job.put("tracker_project_name", str(name) if name else "ai-toolkit", "config.name")
    _model(job, _section(job, process, "model"))
    _network(job, _section(job, process, "network"))
    _save(job, _section(job, process, "save"))
    train = _section(job, process, "train")
    fork_optimizer = process.get("optimizer")
    if fork_optimizer is not None and not isinstance(fork_optimizer, dict):
        job.stop("optimizer", "must be a mapping (`name` and the optimizer's settings)")
        fork_optimizer = None
    _train(job, train, fork_optimizer)
    trigger = process.get("trigger_word")
    model = process.get("model")
    low_vram = isinstance(model, dict) and bool(model.get("low_vram"))
    _sample(job, _section(job, process, "sample"), bool(train.get("disable_sampling")), trigger, low_vram)
    datasets(job, process, train, trigger)
    own = {
        "type", "training_folder", "model", "network", "save", "train", "sample", "datasets", "dataset",
        "optimizer", "trigger_word", "name",
    }  # fmt: skip
    for key, value in process.items():
        if key not in own:
            _generic(job, "process", key, value, key)
    job.out.pop("__trigger_only__", None)
    if job.problems:
        once = list(dict.fromkeys(job.problems))  # a key read once per dataset of a resolution list is said once
        raise DialectError([*once, "(read as an ai-toolkit job; `simpletuner convert` shows the mapping)"], source)
    return job.out, job.report
