"""Keys (and a few values) of other trainers' configs, so an error can say what they are here.

People bring configs from SimpleTuner, kohya sd-scripts and ai-toolkit. When one of their keys
is not ours, guessing the nearest spelling of ours ("did you mean ...") is usually wrong; this
table says instead what the key is, which of our keys does the same job, or that it is not
supported yet. It only shapes error messages: nothing here translates a config (the full
SimpleTuner dialect table of issue 15 grows from this one, adding what each key maps to).

Each entry's ``kind``:
  ``same``          our key ``ours`` means the same thing: use it instead.
  ``approximated``  ``ours`` is the nearest setting; ``note`` says what differs.
  ``unsupported``   nothing here does it yet; ``note`` says what happens instead.
  ``ignored``       irrelevant here (e.g. hub uploads); ``note`` says why.
A key that is also one of ours must not be in the table (a test checks): it is ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

Kind = Literal["same", "approximated", "unsupported", "ignored"]
Section = Literal["top", "dataset"]

SIMPLETUNER = "SimpleTuner"
KOHYA = "kohya sd-scripts"
AI_TOOLKIT = "ai-toolkit"


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


_AIT_NESTED = (
    "an ai-toolkit job file nests its settings under config.process[0]; this trainer reads one flat JSON "
    "object of the keys in documentation/CONFIG.md"
)
_NO_HUB = "this trainer does not upload to the Hugging Face Hub"

FOREIGN_KEYS: tuple[ForeignKey, ...] = (
    # --- SimpleTuner (config/config.json; keys may carry a leading `--`) ---
    _st("model_type", "training_type", "same", "`lora` or `full`"),
    _st(
        "model_flavour",
        "pretrained_model_name_or_path",
        "approximated",
        "a flavour names a hub model; here give the local diffusers folder (Wan 2.2 `-high` / `-low`: `train_stages`)",
    ),
    _st("checkpoint_step_interval", "checkpointing_steps", "same"),
    _st("validation_step_interval", "validation_steps", "same"),
    _st("validation_guidance", "validation_guidance_scale", "same"),
    _st("validation_resolution", None, "unsupported", "validation images use `resolution`"),
    _st("validation_seed", None, "unsupported", "validation images use `seed`"),
    _st("validation_negative_prompt", None, "unsupported", "validation uses no negative prompt"),
    _st("validation_guidance_rescale", None, "unsupported", "validation applies no guidance rescale"),
    _st("validation_torch_compile", None, "unsupported", "the validation pipeline is not compiled"),
    _st(
        "disable_benchmark",
        None,
        "unsupported",
        "validation runs at the start (with `validation_prompt`) and cannot be skipped",
    ),
    _st("caption_dropout_probability", None, "unsupported", "captions are never dropped"),
    _st(
        "lycoris_config",
        "lycoris",
        "approximated",
        "LyCORIS settings are the `lycoris` table (algo, factor, full_matrix) with `lora_rank` / `lora_alpha`, "
        "not a JSON file",
    ),
    _st("use_dora", "lora_use_dora", "same"),
    _st("adam_weight_decay", "weight_decay", "same"),
    _st("optimizer_beta1", "adam_beta1", "same"),
    _st("optimizer_beta2", "adam_beta2", "same"),
    _st("flow_schedule_shift", "flow_shift", "same"),
    _st("disable_tf32", "enable_tf32", "approximated", "inverted: `disable_tf32: true` is `enable_tf32: false`"),
    _st(
        "resolution_type",
        None,
        "unsupported",
        "`resolution` is always a side in pixels whose square is the bucket area (SimpleTuner's `pixel_area`)",
    ),
    _st(
        "minimum_image_size",
        "datasets[].minimum_image_size",
        "approximated",
        "set per dataset here, always in pixels of the shorter side (SimpleTuner's unit follows `resolution_type`)",
    ),
    _st("aspect_bucket_rounding", None, "unsupported", "bucket sides are multiples of `aspect_bucket_alignment`"),
    _st("noise_offset", None, "unsupported", "no noise offset is applied"),
    _st("loss_type", None, "unsupported", "the loss is mean squared error (see `loss_weighting`)"),
    _st("use_ema", None, "unsupported", "no EMA copy of the weights is kept"),
    _st("ema_decay", None, "unsupported", "no EMA copy of the weights is kept"),
    _st("train_text_encoder", None, "unsupported", "text encoders stay frozen (their outputs are cached)"),
    _st("text_encoder_lr", None, "unsupported", "text encoders stay frozen (their outputs are cached)"),
    _st("lr_end", None, "unsupported", "schedules decay as diffusers' `get_scheduler` defines them"),
    _st("tracker_run_name", None, "unsupported", "the tracker names the run"),
    _st("logging_dir", None, "unsupported", "logs are written under `output_dir`"),
    _st("hub_model_id", None, "ignored", _NO_HUB),
    _st("push_to_hub", None, "ignored", _NO_HUB),
    _st("push_checkpoints_to_hub", None, "ignored", _NO_HUB),
    # SimpleTuner dataloader (multidatabackend.json) entries
    _st(
        "crop",
        None,
        "unsupported",
        "each image is resized into its aspect bucket and only the overshoot is cropped (`crop_style`)",
        "dataset",
    ),
    _st(
        "crop_aspect",
        None,
        "unsupported",
        "each image is resized into its aspect bucket and only the overshoot is cropped (`crop_style`)",
        "dataset",
    ),
    _st(
        "resolution_type",
        None,
        "unsupported",
        "`resolution` is always a side in pixels whose square is the bucket area (SimpleTuner's `pixel_area`)",
        "dataset",
    ),
    _st("maximum_image_size", None, "unsupported", "large images are resized to `resolution`", "dataset"),
    _st("target_downsample_size", None, "unsupported", "large images are resized to `resolution`", "dataset"),
    _st(
        "cache_dir_vae",
        "cache_config.cache_dir",
        "approximated",
        "one cache root at the top level holds every dataset's latents",
        "dataset",
    ),
    _st(
        "probability",
        None,
        "unsupported",
        "datasets are sampled in proportion to their size; `repeats` weights one up",
        "dataset",
    ),
    _st("only_instance_prompt", "caption_strategy", "approximated", '`caption_strategy: "instance_prompt"`', "dataset"),
    _st("prepend_instance_prompt", None, "unsupported", "captions are used as they are", "dataset"),
    _st(
        "vae_cache_clear_each_epoch",
        "augmentations_cache_mode",
        "approximated",
        'top-level `augmentations_cache_mode: "refresh_each_epoch"`',
        "dataset",
    ),
    _st("is_regularisation_data", None, "unsupported", "regularisation datasets are not supported yet", "dataset"),
    _st("disabled", None, "unsupported", "remove the entry to leave a dataset out", "dataset"),
    _st(
        "text_embeds",
        "cache_config.cache_dir",
        "approximated",
        "text embeddings are cached under the top-level cache root",
        "dataset",
    ),
    _st(
        "aws_bucket_name",
        None,
        "unsupported",
        'S3 storage is not supported: copy the data to a folder and use `type: "local"`',
        "dataset",
    ),
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
    _kohya("text_encoder_lr", None, "unsupported", "text encoders stay frozen (their outputs are cached)"),
    _kohya("min_snr_gamma", "snr_gamma", "approximated", 'also set `loss_weighting: "min_snr"`'),
    _kohya("noise_offset", None, "unsupported", "no noise offset is applied"),
    _kohya("loss_type", None, "unsupported", "the loss is mean squared error (see `loss_weighting`)"),
    _kohya("caption_dropout_rate", None, "unsupported", "captions are never dropped"),
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
    _kohya("logging_dir", None, "unsupported", "logs are written under `output_dir`"),
    _kohya("save_model_as", None, "unsupported", "adapters are saved as diffusers-format safetensors"),
    _kohya(
        "caption_extension", None, "unsupported", 'captions are read from `.txt` files (`caption_strategy: "textfile"`)'
    ),
    _kohya("shuffle_caption", None, "unsupported", "captions are used as they are"),
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
    _ait("ema_config", None, "unsupported", "no EMA copy of the weights is kept"),
    _ait("folder_path", "instance_data_dir", "same", section="dataset"),
    _ait(
        "caption_ext",
        None,
        "unsupported",
        'captions are read from `.txt` files (`caption_strategy: "textfile"`)',
        "dataset",
    ),
    _ait("caption_dropout_rate", None, "unsupported", "captions are never dropped", "dataset"),
    _ait("shuffle_tokens", None, "unsupported", "captions are used as they are", "dataset"),
    _ait(
        "cache_latents_to_disk",
        "cache_config.vae_cache_type",
        "approximated",
        '`"disk"` at the top level, the default',
        "dataset",
    ),
)

FOREIGN_VALUES: tuple[ForeignValue, ...] = (
    ForeignValue("base_model_precision", "int8-quanto", SIMPLETUNER, "qint8"),
    ForeignValue("base_model_precision", "fp8-quanto", SIMPLETUNER, "qfloat8"),
    ForeignValue("base_model_precision", "int8-torchao", SIMPLETUNER, "int8_torchao"),
    ForeignValue("base_model_precision", "fp8-torchao", SIMPLETUNER, "fp8_torchao"),
    ForeignValue(
        "base_model_precision", "int4-quanto", SIMPLETUNER, None, "4-bit weights are not supported; the 8-bit kinds are"
    ),
    ForeignValue(
        "base_model_precision", "nf4-bnb", SIMPLETUNER, None, "bitsandbytes is not supported; the 8-bit kinds are"
    ),
    ForeignValue("model_family", "sd1x", SIMPLETUNER, "sd"),
    ForeignValue("model_family", "sd2x", SIMPLETUNER, "sd"),
    ForeignValue("model_family", "legacy", SIMPLETUNER, "sd"),
    ForeignValue(
        "optimizer",
        "adamw_bf16",
        SIMPLETUNER,
        None,
        "`adamw` trains fp32 adapter weights; `automagic` rounds stochastically into bf16 weights",
    ),
    ForeignValue("optimizer", "adamw8bit", AI_TOOLKIT, None, "8-bit optimizers are not supported; use `adamw`"),
    ForeignValue(
        "mixed_precision",
        "fp8",
        SIMPLETUNER,
        None,
        "there is no fp8 autocast; use `bf16` and store the base in 8 bits with `base_model_precision`",
    ),
    ForeignValue("caption_strategy", "instanceprompt", SIMPLETUNER, "instance_prompt"),
    ForeignValue(
        "caption_strategy",
        "parquet",
        SIMPLETUNER,
        None,
        "captions come from .txt files, file names or `instance_prompt`",
    ),
    ForeignValue(
        "type", "aws", SIMPLETUNER, None, "S3 storage is not supported: copy the data to a folder and use `local`"
    ),
    ForeignValue(
        "dataset_type",
        "text_embeds",
        SIMPLETUNER,
        None,
        "text embeddings are cached under `cache_config.cache_dir`: remove this entry",
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
