"""Keys (and a few values) of other trainers' configs (SimpleTuner, kohya sd-scripts, ai-toolkit), so an error
can say what they are here: which of our keys does the same job, or that nothing does yet. It only shapes error
messages (documentation/CONFIG.md, "Keys from other tools"); a SimpleTuner config *file* is translated instead,
and its rows here are generated from that translator's table. A key that is also one of ours must not be in the
table (a test checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, get_args

from simpletuner.configuration.dataset_sections import dataset_keys
from simpletuner.configuration.schema import LocalDatasetConfig, TrainingConfig
from simpletuner.configuration.simpletuner import facts
from simpletuner.configuration.simpletuner import translate as dialect
from simpletuner.configuration.simpletuner.reading import Kind, Section

SIMPLETUNER = "SimpleTuner"
KOHYA = "kohya sd-scripts"
AI_TOOLKIT = "ai-toolkit"
#: The small-language-model trainer whose GPU tuning guide (seed 004) sets `slm_config` knobs.
SLM_GUIDE = "GPU tuning guide (slm_config)"


@dataclass(frozen=True)
class ForeignKey:
    """One key of another tool's config: what it is called there and what plays its part here."""

    key: str
    tool: str
    ours: Optional[str]  # our key (dotted path when nested), or None
    kind: Kind
    note: str = ""
    section: Section = "top"  # "top": a top-level key; "dataset": a key of a dataset entry


@dataclass(frozen=True)
class ForeignValue:
    """A value another tool spells differently for a key we share (same name, other values)."""

    key: str
    value: str
    tool: str
    ours: Optional[str]  # our spelling of the value, or None when nothing here matches
    note: str = ""


def _st(key, ours, kind, note="", section="top"):
    return ForeignKey(key, SIMPLETUNER, ours, kind, note, section)


def _kohya(key, ours, kind, note="", section="top"):
    return ForeignKey(key, KOHYA, ours, kind, note, section)


def _ait(key, ours, kind, note="", section="top"):
    return ForeignKey(key, AI_TOOLKIT, ours, kind, note, section)


def _slm(key, ours, kind, note=""):
    return ForeignKey(key, SLM_GUIDE, ours, kind, note)


def _native_keys(section: Section) -> frozenset[str]:
    if section == "top":
        return frozenset(TrainingConfig.model_fields)
    return dataset_keys()


def _simpletuner_keys() -> list[ForeignKey]:
    """SimpleTuner's keys that are not ours, as its dialect table describes them (one source: a SimpleTuner
    config file is translated by that table; these entries name its keys when they reach a native config,
    through `--set` or an API dict)."""
    out = []
    for entry in dialect.DIALECT:
        if entry.key in _native_keys(entry.section):
            continue
        # a key mapped with no key of its own (read with others, as `aspect_bucket_rounding`) has nothing to
        # name in a native config: there it does nothing
        kind = "ignored" if entry.ours is None and entry.kind in ("same", "approximated") else entry.kind
        out.append(ForeignKey(entry.key, SIMPLETUNER, entry.ours, kind, entry.note, entry.section))
    return out


def _native_choices(key: str) -> frozenset:
    """The values our key ``key`` takes, when it is a choice (a Literal)."""
    for model in (TrainingConfig, LocalDatasetConfig):
        field = model.model_fields.get(key)
        if field is not None:
            args = get_args(field.annotation)
            inner = [a for a in args if get_args(a)] or [field.annotation]
            return frozenset(v for a in inner for v in get_args(a) if isinstance(v, str)) | frozenset(
                a for a in args if isinstance(a, str)
            )
    return frozenset()


def _simpletuner_values() -> list[ForeignValue]:
    """SimpleTuner's spellings of values of keys we share (its dialect's value tables); a value that is
    also one of ours is ours (SimpleTuner's `caption_strategy: csv` means another thing, see the dialect)."""
    out = []
    for key, table in facts.VALUE_TABLES.items():
        for value, ours in table.items():
            if value == ours or value in _native_choices(key):
                continue
            note = "" if ours is not None else f"not supported here; `simpletuner convert` lists what works for `{key}`"
            out.append(ForeignValue(key, value, SIMPLETUNER, ours, note))
    return out


_AIT_NESTED = (
    "an ai-toolkit job file nests its settings under config.process[0]; this trainer reads one flat JSON "
    "object of the keys in documentation/CONFIG.md"
)

FOREIGN_KEYS: tuple[ForeignKey, ...] = (
    # --- SimpleTuner: generated from the dialect table (configuration/simpletuner/) ---
    *_simpletuner_keys(),
    # --- kohya sd-scripts (train_network.py arguments) ---
    _kohya("network_dim", "lora_rank", "same"),
    _kohya("network_alpha", "lora_alpha", "same"),
    _kohya("network_dropout", "lora_dropout", "same"),
    _kohya(
        "network_module",
        "lora_type",
        "approximated",
        '`networks.lora` is `lora_type: "standard"`, `lycoris.kohya` is `lora_type: "lycoris"`',
    ),
    _kohya("network_args", "lycoris", "approximated", "LyCORIS `algo` / `factor` go in the `lycoris` table"),
    _kohya("network_weights", None, "unsupported", "training cannot start from an existing LoRA file"),
    _kohya(
        "train_data_dir",
        "datasets",
        "approximated",
        "each image folder is a `datasets[]` entry with `instance_data_dir`",
    ),
    _kohya(
        "dataset_config",
        "datasets",
        "approximated",
        "datasets are listed inline (`datasets`) or in a JSON file (`data_backend_config`), not in TOML",
    ),
    _kohya("reg_data_dir", None, "unsupported", "regularisation images are not supported yet"),
    _kohya("output_name", None, "unsupported", "the adapter is saved in `output_dir` under the diffusers file name"),
    _kohya(
        "save_every_n_steps",
        "checkpointing_steps",
        "approximated",
        "saves a resumable checkpoint every N optimizer steps",
    ),
    _kohya("save_every_n_epochs", "checkpointing_steps", "approximated", "checkpoints are counted in optimizer steps"),
    _kohya("max_train_epochs", "num_train_epochs", "same"),
    _kohya("optimizer_type", "optimizer", "approximated", "see `optimizer` for the choices (no 8-bit optimizers)"),
    _kohya("unet_lr", "learning_rate", "approximated", "only the denoiser trains, at `learning_rate`"),
    _kohya("min_snr_gamma", "snr_gamma", "approximated", 'also set `loss_weighting: "min_snr"`'),
    _kohya("caption_dropout_rate", "caption_dropout_probability", "same"),
    _kohya("sample_every_n_steps", "validation_steps", "approximated", "with `validation_prompt`"),
    _kohya(
        "sample_prompts",
        "validation_prompts",
        "approximated",
        "a text file, one prompt per line; per-prompt options (--n, --w, --s, --d, ...) are not read: remove them",
    ),
    _kohya("cache_latents", None, "ignored", "latents are cached unless `augmentations_cache_mode` is `disable_cache`"),
    _kohya("cache_latents_to_disk", "cache_config.vae_cache_type", "approximated", '`"disk"`, the default'),
    _kohya("max_data_loader_n_workers", "dataloader_num_workers", "approximated", "image-decoding threads"),
    _kohya("persistent_data_loader_workers", "dataloader_persistent_workers", "same"),
    _kohya("log_with", "report_to", "same", "`tensorboard` or `wandb`"),
    _kohya("logging_dir", None, "ignored", "logs are written under `output_dir`"),
    _kohya("save_model_as", None, "unsupported", "adapters are saved as diffusers-format safetensors"),
    _kohya(
        "caption_extension", None, "unsupported", 'captions are read from `.txt` files (`caption_strategy: "textfile"`)'
    ),
    _kohya(
        "shuffle_caption",
        "datasets[].caption_shuffle",
        "approximated",
        'per dataset: `caption_shuffle: {"enable": true, "count": N}` makes N shuffled copies of each caption, each '
        "encoded once, one drawn per use (kohya shuffles anew at every use)",
    ),
    _kohya(
        "keep_tokens",
        "datasets[].caption_shuffle",
        "approximated",
        "`caption_shuffle.position_start`: the comma-separated tags kept in front while the rest shuffle",
    ),
    _kohya("enable_bucket", None, "ignored", "aspect bucketing is always on"),
    _kohya("bucket_reso_steps", "aspect_bucket_alignment", "same"),
    _kohya("xformers", None, "ignored", "attention uses PyTorch's scaled_dot_product_attention"),
    _kohya("sdpa", None, "ignored", "attention uses PyTorch's scaled_dot_product_attention"),
    _kohya("fp8_base", "base_model_precision", "approximated", '`"qfloat8"` or `"fp8_torchao"`'),
    _kohya("v_parameterization", "prediction_type", "approximated", '`prediction_type: "v_prediction"`'),
    _kohya("discrete_flow_shift", "flow_shift", "same"),
    _kohya("clip_skip", None, "unsupported", "prompts are encoded from the text encoder's usual layer"),
    # --- ai-toolkit (YAML job files; people paste the nested sections at the top level) ---
    _ait("job", None, "unsupported", _AIT_NESTED),
    _ait("config", None, "unsupported", _AIT_NESTED),
    _ait("meta", None, "unsupported", _AIT_NESTED),
    _ait("process", None, "unsupported", _AIT_NESTED),
    _ait("training_folder", "output_dir", "same"),
    _ait("trigger_word", "datasets[].instance_prompt", "approximated", 'with `caption_strategy: "instance_prompt"`'),
    _ait("device", None, "ignored", "Accelerate picks the device"),
    _ait(
        "network",
        "lora_rank",
        "approximated",
        "`network.linear` is `lora_rank`, `network.linear_alpha` is `lora_alpha`",
    ),
    _ait(
        "train",
        None,
        "unsupported",
        "its keys are top-level here: `train_batch_size`, `max_train_steps`, `learning_rate`, ...",
    ),
    _ait(
        "model",
        "pretrained_model_name_or_path",
        "approximated",
        "`model.name_or_path` is `pretrained_model_name_or_path`; `model_family` names the architecture",
    ),
    _ait(
        "sample",
        "validation_prompts",
        "approximated",
        "validation: `validation_prompts` (or one `validation_prompt`), `validation_steps`, ...",
    ),
    _ait("save", "checkpointing_steps", "approximated", "`save.save_every` is `checkpointing_steps`"),
    _ait("batch_size", "train_batch_size", "same"),
    _ait("steps", "max_train_steps", "same"),
    _ait("lr", "learning_rate", "same"),
    _ait("dtype", "mixed_precision", "approximated", "the autocast precision; adapters train in fp32"),
    _ait("noise_scheduler", None, "ignored", "the model family's own schedule is used"),
    _ait("train_unet", None, "ignored", "the denoiser always trains"),
    _ait("ema_config", "use_ema", "approximated", "`use_ema`, `ema_decay`, `ema_update_interval`"),
    _ait("folder_path", "instance_data_dir", "same", section="dataset"),
    _ait(
        "caption_ext",
        None,
        "unsupported",
        'captions are read from `.txt` files (`caption_strategy: "textfile"`)',
        "dataset",
    ),
    _ait(
        "caption_dropout_rate",
        "caption_dropout_probability",
        "approximated",
        "one top-level probability here, for every dataset",
        "dataset",
    ),
    _ait("shuffle_tokens", None, "unsupported", "captions are used as they are", "dataset"),
    _ait(
        "cache_latents_to_disk",
        "cache_config.vae_cache_type",
        "approximated",
        '`"disk"` at the top level, the default',
        "dataset",
    ),
    # --- a GPU tuning guide's `slm_config` (its enable_tf32 / enable_compile / batch_size-like keys are ours) ---
    _slm(
        "enable_amp",
        "mixed_precision",
        "approximated",
        '`enable_amp: true` with `amp_dtype: "bf16"` is `mixed_precision: "bf16"` ("fp16" likewise); '
        '`enable_amp: false` is `mixed_precision: "no"`',
    ),
    _slm("amp_dtype", "mixed_precision", "same", '`"bf16"` or `"fp16"`, spelled the same'),
)

FOREIGN_VALUES: tuple[ForeignValue, ...] = (
    *_simpletuner_values(),
    ForeignValue("optimizer", "adamw8bit", AI_TOOLKIT, None, "8-bit optimizers are not supported; use `adamw`"),
    ForeignValue(
        "type",
        "aws",
        SIMPLETUNER,
        "object_store",
        "with `instance_data_dir: s3://<bucket>/<prefix>` and `storage_options` for the endpoint and credentials",
    ),
    ForeignValue(
        "dataset_type",
        "text_embeds",
        SIMPLETUNER,
        None,
        "a SimpleTuner text-cache entry: set `cache_config.text_cache_dir` to its `cache_dir` and remove the entry",
    ),
)


def foreign_key(key: str, section: Section = "top") -> list[ForeignKey]:
    """Every table entry for ``key`` in ``section`` (several tools may share a key), first tool first."""
    return [entry for entry in FOREIGN_KEYS if entry.key == key and entry.section == section]


def foreign_value(key: str, value: object) -> Optional[ForeignValue]:
    """The table entry for another tool's spelling ``value`` of our key ``key``, if any."""
    for entry in FOREIGN_VALUES:
        if entry.key == key and entry.value == value:
            return entry
    return None


def describe_foreign_key(entries: list[ForeignKey], written: str) -> str:
    """The message for a key of another tool: what it is, and what to write here instead."""
    first = entries[0]
    tools = " and ".join(dict.fromkeys(e.tool for e in entries))
    article = "an" if tools[0].lower() in "aeiou" else "a"
    ours, note = first.ours, first.note
    if first.kind == "same":
        extra = f" ({note})" if note else ""
        return f"`{written}` is the {tools} name of `{ours}`{extra}: use `{ours}` instead"
    if first.kind == "approximated":
        return f"`{written}` is {article} {tools} key; the nearest setting here is `{ours}` ({note}): use it instead"
    if first.kind == "ignored":
        return f"`{written}` is {article} {tools} key with no effect here ({note}): remove it"
    return f"`{written}` is {article} {tools} key that this trainer does not support yet: {note}; remove it"


def describe_foreign_value(entry: ForeignValue) -> str:
    """The hint added to 'X is not one of ...' when X is another tool's spelling."""
    if entry.ours is not None:
        extra = f" ({entry.note})" if entry.note else ""
        return f"{entry.value!r} is {entry.tool}'s spelling of {entry.ours!r}{extra}: use {entry.ours!r}"
    return f"{entry.value!r} is a {entry.tool} value with no equivalent here: {entry.note}"


def stands_for(key: str, section: Optional[Section], fields) -> Optional[str]:
    """Our key that the unknown ``key`` sets under another name, or None.

    That is ours written with SimpleTuner's leading ``--``, or another tool's name of the *same*
    setting. The loader treats such a key of ours as unreadable rather than unset, so no rule or
    "missing" line is reported for it on top of the line about ``key`` itself.
    """
    bare = key.lstrip("-")
    if bare != key and bare in fields:
        return bare
    for entry in foreign_key(bare, section) if section else []:
        if entry.kind == "same" and entry.ours in fields:
            return entry.ours
    return None
