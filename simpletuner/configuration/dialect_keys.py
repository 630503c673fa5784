"""What each SimpleTuner key means here: the mapped part of the dialect table (``CORE`` for config.json,
``DATASET_CORE`` for multidatabackend.json entries, ``TOP_DATASET_KEYS`` for top-level keys that are each
dataset's default) and how each value is written into the native config. The long tail of ignored and
unsupported keys is ``dialect_tail.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from simpletuner.configuration.dialect_read import (
    DialectKey,
    Kind,
    Problem,
    Section,
    Translation,
    as_bool,
    as_number,
    is_inert,
    plain,
    read_json_file,
    set_spelled,
    spelled,
)
from simpletuner.configuration.dialect_values import (
    CAPTION_STRATEGIES,
    DATASET_DEFAULTS_FROM_TOP,
    FAMILIES,
    FLAVOUR_UNSUPPORTED,
    FLAVOURS,
    LIFTED_OPTIMIZER_SETTINGS,
    LR_SCHEDULERS,
    LYCORIS_KEYS,
    MIXED,
    OPTIMIZERS,
    PRECISIONS,
)
from simpletuner.configuration.optimizer_settings import parse_optimizer_config


def _model_family(t: Translation, value: Any, entry: DialectKey) -> None:
    text = str(value).strip()
    ours = FAMILIES.get(text)
    if ours is None:
        t.problems.append(
            f"`model_family`: {text!r} is not a family this trainer trains; the SimpleTuner families that work "
            f"here are {', '.join(FAMILIES)}"
        )
        return
    t.put("model_family", ours, entry.key)


def hub_advice(hub_id: str) -> str:
    return (
        f"it stands for the hub model {hub_id}, and this trainer downloads nothing: on a machine with network run "
        f"`huggingface-cli download {hub_id} --local-dir /path/to/{hub_id.split('/')[-1]}`, copy the folder here, "
        "and set `pretrained_model_name_or_path` to it"
    )


def resolve_flavour(t: Translation, flavour: str, model_path: Any) -> None:
    """What ``model_flavour`` means here: Wan 2.2 ``-high`` / ``-low`` set ``train_stages`` and
    ``ti2v-5b-2.2`` sets ``ti2v_first_frame``; a flavour of a kind not trained here stops; without a local
    ``pretrained_model_name_or_path`` it stops with the hub id it stands for and the download command."""
    family = t.family or ""
    table = FLAVOURS.get(family, {})
    if flavour not in table:
        known = ", ".join(table) or "none"
        t.problems.append(f"`model_flavour`: {flavour!r} is not a SimpleTuner flavour of {family!r} (known: {known})")
        return
    for marker, why in FLAVOUR_UNSUPPORTED.items():
        if flavour.startswith(marker):
            t.problems.append(f"`model_flavour`: {flavour!r}: {why}")
            return
    if flavour.endswith("-high") or flavour.endswith("-low"):
        t.put("train_stages", flavour.rsplit("-", 1)[1], "model_flavour")
    if flavour.startswith("ti2v"):  # SimpleTuner trains TI2V-5B with the first frame as the condition
        t.put("ti2v_first_frame", True, "model_flavour")
    if model_path is None and "pretrained_model_name_or_path" not in t.sources:
        t.problems.append(
            f"`model_flavour`: {flavour!r}: no `pretrained_model_name_or_path` is set; {hub_advice(table[flavour])}"
        )


def _same_folder(t: Translation, value: Any, entry: DialectKey) -> None:
    """A component path that names the model folder itself (or nothing) asks for nothing extra."""
    model = t.bare.get("pretrained_model_name_or_path")
    if is_inert(value) or value == model:
        t.ignore(entry.key, "the model folder itself")
    else:
        t.problems.append(f"`{entry.key}` = {value!r}: {entry.note}")


def _model_path(t: Translation, value: Any, entry: DialectKey) -> None:
    """A local folder (relative ones from the working directory, as SimpleTuner reads them); a hub id
    stops with the download command, since nothing is downloaded here."""
    if isinstance(value, str) and value:
        local = os.path.normpath(os.path.join(t.cwd, os.path.expanduser(value)))
        if os.path.isdir(local):
            value = local
        elif value.count("/") == 1 and not value.startswith((".", "/", "~")):
            t.problems.append(f"`{entry.key}`: {value!r} is not a local folder; {hub_advice(value)}")
            return
    t.put("pretrained_model_name_or_path", value, entry.key)


def _path_key(t: Translation, value: Any, entry: DialectKey) -> None:
    assert entry.ours is not None
    t.put(entry.ours, t.path(value, entry.key), entry.key)


def _resume(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        return
    t.put("resume_from_checkpoint", value if value == "latest" else t.path(value, entry.key), entry.key)


def _epochs(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        epochs = as_number(value, entry.key)
    except Problem as exc:
        t.problems.append(str(exc))
        return
    if epochs == 0:  # SimpleTuner: 0 epochs means "train for max_train_steps"
        t.report.mapped.append("`num_train_epochs: 0` -> unset (`max_train_steps` decides)")
        return
    t.put("num_train_epochs", epochs, entry.key)


def _max_steps(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        steps = as_number(value, entry.key)
    except Problem as exc:
        t.problems.append(str(exc))
        return
    if steps == 0:
        return  # SimpleTuner: 0 means "use num_train_epochs"
    t.put("max_train_steps", steps, entry.key)


def _inverted_tf32(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        t.put("enable_tf32", not as_bool(value, entry.key), entry.key)
    except Problem as exc:
        t.problems.append(str(exc))


def _snr_gamma(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        return  # SimpleTuner: no gamma, no Min-SNR weighting
    t.put("snr_gamma", plain(value), entry.key)
    t.put("loss_weighting", "min_snr", entry.key)


def _report_to(t: Translation, value: Any, entry: DialectKey) -> None:
    text = str(value).strip().lower()
    if text in ("none", "", "null"):
        t.put("report_to", "none", entry.key)
    elif text in ("tensorboard", "wandb"):
        t.put("report_to", text, entry.key)
    else:
        t.problems.append(
            f"`report_to`: {value!r}: this trainer logs to `tensorboard` or `wandb` (one tracker), or `none`"
        )


def _hub(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        on = as_bool(value, entry.key)
    except Problem as exc:
        t.problems.append(str(exc))
        return
    if on:
        t.problems.append(
            f"`{entry.key}: true`: this trainer does not upload to the Hugging Face Hub; set it to false and upload "
            "the output folder yourself (`huggingface-cli upload`)"
        )
    else:
        t.ignore(entry.key, "hub uploads are off")


def _validation_prompt(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        return
    t.put("validation_prompt", value, entry.key)


def _lycoris_config(t: Translation, value: Any, entry: DialectKey) -> None:
    """The LyCORIS JSON file (from the working directory, as SimpleTuner reads it) becomes the `lycoris` table."""
    path = Path(t.path(value, entry.key))
    settings = read_json_file(t, path, "lycoris_config", dict, "a JSON object")
    if settings is None:
        return
    t.report.notes.append(f"LyCORIS settings read from {path}")
    for key, item in settings.items():
        ours = LYCORIS_KEYS.get(key)
        if ours is None:
            t.problems.append(f"`lycoris_config` ({path}): `{key}` is not supported here: remove it")
            continue
        t.put(ours, plain(item), f"lycoris_config:{key}")
        t.report.mapped.append(f"`lycoris_config:{key}` -> `{ours}`")


def _data_backend_config(t: Translation, value: Any, entry: DialectKey) -> None:
    """Found as SimpleTuner finds it: from the working directory, then beside the config file."""
    if not isinstance(value, str) or not value:
        t.problems.append("`data_backend_config` must be the path of a multidatabackend JSON file")
        return
    candidates = [Path(os.path.expanduser(value))]
    if not candidates[0].is_absolute():
        candidates = [t.cwd / candidates[0]] + ([t.config_dir / value] if t.config_dir is not None else [])
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        tried = " and ".join(str(p) for p in candidates)
        t.problems.append(f"`data_backend_config`: {value!r} not found (looked at {tried})")
        return
    entries = read_json_file(t, found, "data_backend_config", list, "a JSON list of dataset entries")
    if entries is None:
        return
    t.report.notes.append(f"datasets read from {found}")
    t.out["__datasets__"] = entries


def _entry(key: str, kind: Kind, ours: Optional[str] = None, note: str = "", section: Section = "top", **kw):
    return DialectKey(key, section, kind, ours, note, **kw)


def _same(key: str, ours: Optional[str] = None, note: str = "", **kw):
    return _entry(key, "same", ours or key, note, **kw)


def _optimizer_config(t: Translation, value: Any, entry: DialectKey) -> None:
    """SimpleTuner's `key=value,...` string (or object); settings with a key of their own here move there."""
    try:
        settings = parse_optimizer_config(value)
    except ValueError as exc:
        t.problems.append(f"`optimizer_config`: {exc}")
        return
    if not isinstance(settings, dict):
        t.problems.append(f"`optimizer_config`: {value!r} is not `key=value,...` or an object")
        return
    rest = {}
    for key, item in settings.items():
        if key in LIFTED_OPTIMIZER_SETTINGS:
            t.put(LIFTED_OPTIMIZER_SETTINGS[key], item, f"optimizer_config:{key}")
        elif key == "betas" and isinstance(item, (list, tuple)) and len(item) == 2:
            t.put("adam_beta1", item[0], "optimizer_config:betas")
            t.put("adam_beta2", item[1], "optimizer_config:betas")
        else:
            rest[key] = item
    if rest:
        t.put("optimizer_config", rest, entry.key)


#: The keys this module maps itself (the rest of the dialect is in dialect_tail.TAIL).
CORE: tuple[DialectKey, ...] = (
    # --- model ---
    _same("model_type", "training_type", "`lora` or `full`", values={"lora": "lora", "full": "full"}),
    _same("model_family", "model_family", "sd1x / sd2x / legacy -> `sd`", apply=_model_family),
    _entry(
        "model_flavour",
        "approximated",
        "pretrained_model_name_or_path",
        "names a hub model; here `pretrained_model_name_or_path` must be a local folder (no downloads); Wan 2.2 "
        "`-high` / `-low` set `train_stages`",
    ),
    _same("pretrained_model_name_or_path", apply=_model_path),
    _same("prediction_type"),
    _same("revision"),
    _entry(
        "pretrained_transformer_model_name_or_path",
        "unsupported",
        note="the denoiser is loaded from `pretrained_model_name_or_path`: put the transformer / UNet you want into "
        "that folder",
        apply=lambda t, v, e: _same_folder(t, v, e),
    ),
    _entry(
        "pretrained_t5_model_name_or_path",
        "unsupported",
        note="text encoders are loaded from `pretrained_model_name_or_path`: put the T5 you want into that folder",
        apply=lambda t, v, e: _same_folder(t, v, e),
    ),
    _entry(
        "pretrained_vae_model_name_or_path",
        "unsupported",
        note="the VAE is loaded from `pretrained_model_name_or_path`: put the VAE you want into that folder",
        apply=lambda t, v, e: _same_folder(t, v, e),
    ),
    _entry(
        "seed_for_each_device",
        "ignored",
        note="each process draws its own noise here (its generator is seeded from `seed` and its rank)",
    ),
    _same("aspect_bucket_alignment"),
    _same("base_model_precision", apply=set_spelled(PRECISIONS, "8-bit quanto / torchao kinds only")),
    _same("train_stages"),
    # --- schedule and optimisation ---
    _same("num_train_epochs", note="0 means: train for `max_train_steps`", apply=_epochs),
    _same("max_train_steps", note="0 means: train for `num_train_epochs`", apply=_max_steps),
    _same("train_batch_size"),
    _same("gradient_accumulation_steps"),
    _same("learning_rate"),
    _same("lr_scheduler", apply=set_spelled(LR_SCHEDULERS, "diffusers' schedules")),
    _same("lr_warmup_steps"),
    _same("optimizer", apply=set_spelled(OPTIMIZERS, "AdamW-bf16, Prodigy and optimi's AdamW / Adam / SGD")),
    _same(
        "optimizer_config",
        note="`weight_decay` / `eps` / `betas` in it become `weight_decay` / `adam_epsilon` / `adam_beta1`, "
        "`adam_beta2`",
        apply=lambda t, v, e: _optimizer_config(t, v, e),
    ),
    _same("adam_beta1"),
    _same("adam_beta2"),
    _same("optimizer_beta1", "adam_beta1"),
    _same("optimizer_beta2", "adam_beta2"),
    _same("adam_epsilon"),
    _same("adam_weight_decay", "weight_decay"),
    _same(
        "max_grad_norm",
        note="0 turns clipping off",
        apply=lambda t, v, e: t.put("max_grad_norm", None if is_inert(v) else plain(v), e.key),
    ),
    _same("grad_clip_method"),
    _same("gradient_checkpointing"),
    _same("mixed_precision", apply=set_spelled(MIXED, "no fp8 autocast: bf16 with an 8-bit base_model_precision")),
    _same("seed"),
    _same("snr_gamma", note="also turns on `loss_weighting: min_snr`", apply=_snr_gamma),
    _same("flow_schedule_shift", "flow_shift"),
    _same(
        "flow_sigmoid_scale",
        "logit_std",
        "flow families draw sigmas as sigmoid(N(0, 1) * scale): `timestep_sampling: logit_normal`, `logit_std`",
    ),
    _same("flow_use_uniform_schedule", "timestep_sampling", "true -> `timestep_sampling: uniform`"),
    _entry("flow_use_beta_schedule", "unsupported", note="the beta sigma schedule is not supported: remove it"),
    _same("disable_tf32", "enable_tf32", "inverted", apply=_inverted_tf32),
    # --- adapter ---
    _same("lora_type", values={"standard": "standard", "lycoris": "lycoris"}),
    _same("lora_rank"),
    _same("lora_alpha"),
    _same("lora_dropout"),
    _same("peft_lora_target_modules", "lora_target_modules"),
    _same(
        "flux_lora_target",
        "lora_target_modules",
        "flux LoRA: its named layer sets (`all`, the default, `all+ffs`, `all+ffs+embedder`, `context`, "
        "`context+ffs`) become the module list",
    ),
    _entry("init_lora", "unsupported", note="training cannot start from an existing LoRA file here: remove it"),
    _entry(
        "lora_init_type",
        "unsupported",
        note="adapters start as peft's default (B = 0); other initialisations (gaussian, PiSSA, LoftQ, ...) are not "
        "supported",
        apply=lambda t, v, e: (
            t.ignore(e.key, "peft's default")
            if str(v) == "default"
            else t.problems.append(f"`{e.key}` = {v!r}: {e.note}")
        ),
    ),
    _same("use_dora", "lora_use_dora"),
    _same("lycoris_config", "lycoris", "the JSON file's settings become the `lycoris` table", apply=_lycoris_config),
    # --- loss ---
    _same("loss_type"),
    _same("huber_schedule"),
    _same("huber_c"),
    _same("offset_noise", "noise_offset", "the switch of `noise_offset` (off: no offset); flow families take none"),
    _same("noise_offset", note="applied only with `offset_noise: true`, as in SimpleTuner"),
    _same("noise_offset_probability", note="applied only with `offset_noise: true`"),
    _same("caption_dropout_probability"),
    _same("use_ema"),
    _same("ema_decay"),
    _same("ema_update_interval"),
    _same("ema_validation"),
    _same("ema_device"),
    _same("ema_warmup_steps"),
    _entry(
        "ema_cpu_only",
        "same",
        "ema_device",
        "true -> `ema_device: cpu` (the EMA lives and updates on the CPU)",
        apply=lambda t, v, e: t.put("ema_device", "cpu", e.key) if as_bool(v, e.key) else None,
    ),
    # --- checkpoints, output ---
    _same("output_dir", note="taken from the working directory, made absolute", apply=_path_key),
    _same("checkpoint_step_interval", "checkpointing_steps"),
    _same("checkpointing_steps"),
    _same("checkpoints_total_limit"),
    _same("resume_from_checkpoint", apply=_resume),
    # --- validation ---
    _same("validation_prompt", apply=_validation_prompt),
    _same("validation_step_interval", "validation_steps"),
    _same("validation_steps"),
    _same("validation_guidance", "validation_guidance_scale"),
    _same("validation_num_inference_steps"),
    _same("num_validation_images"),
    _same("validation_resolution"),
    _same("validation_seed"),
    _same("validation_negative_prompt"),
    _same("validation_guidance_rescale"),
    _same("validation_num_video_frames"),
    # --- data ---
    _same("data_backend_config", "datasets", "its entries are translated and inlined", apply=_data_backend_config),
    _same("resolution", note="also each dataset's default, as in SimpleTuner"),
    _same("cache_dir", "cache_config.cache_dir", "made absolute", apply=_path_key),
    _same("cache_dir_text", "cache_config.text_cache_dir", "made absolute", apply=_path_key),
    _entry(
        "eval_steps_interval",
        "approximated",
        "eval_steps",
        "logs a fixed-noise loss on training batches every N steps (`eval_iters` batches), not SimpleTuner's "
        "evaluation datasets",
    ),
    _same("vae_batch_size"),
    # --- logging ---
    _same("report_to", apply=_report_to),
    _same("tracker_project_name"),
    _entry("tracker_run_name", "ignored", note="the tracker names the run"),
    _entry("logging_dir", "ignored", note="logs are written under `output_dir`"),
    _entry("hub_model_id", "ignored", note="this trainer does not upload to the Hugging Face Hub"),
    _entry("push_to_hub", "unsupported", note="this trainer does not upload to the Hugging Face Hub", apply=_hub),
    _entry("push_checkpoints_to_hub", "unsupported", note="this trainer does not upload to the Hub", apply=_hub),
)


def _ds(key: str, kind: Kind = "same", ours: Optional[str] = None, note: str = "", **kw) -> DialectKey:
    return DialectKey(key, "dataset", kind, ours or (key if kind == "same" else None), note, **kw)


def _storage(t: Translation, value: Any, entry: DialectKey) -> None:
    text = str(value).strip()
    if text in ("local", "in_memory"):
        t.put("type", text, entry.key)
    elif text == "aws":  # the bucket, prefix, endpoint and credentials follow from the `aws_*` keys
        t.put("type", "object_store", entry.key)
    elif text == "huggingface":
        t.problems.append(
            f"{t.dataset_label}: `type: huggingface`: Hugging Face Hub datasets are not downloaded by the trainer: "
            "download the dataset's Parquet files (`huggingface-cli download <repo> --repo-type dataset --local-dir "
            "DIR`) and use `type: parquet` with `instance_data_dir` DIR's data folder and its `image_column` / "
            "`caption_column` (documentation/DATA_SOURCES.md)"
        )
    else:
        t.problems.append(f"{t.dataset_label}: `type: {text}` is not supported here: use `type: local`")


#: The keys that together write an `aws` dataset's `instance_data_dir`, ``s3://<aws_bucket_name>/<aws_data_prefix>``.
_S3_LOCATION_KEYS = ("aws_bucket_name", "aws_data_prefix")


def _s3_location(t: Translation, value: Any, entry: DialectKey) -> None:
    """``aws_bucket_name`` / ``aws_data_prefix``: each writes its part of ``s3://<bucket>/<prefix>`` (in any order)."""
    if is_inert(value):  # null / "" (SimpleTuner's examples carry them on entries of other types)
        t.ignore(f"{t.dataset_label}.{entry.key}", "unset")
        return
    slot = f"{t.dataset_label}.instance_data_dir"
    source = t.sources.get(slot)
    if source is not None and source not in _S3_LOCATION_KEYS:
        raise Problem(
            f"`{source}` and `{entry.key}` both say where the data is: for `type: aws` give the folder inside the "
            "bucket as `aws_data_prefix` and remove `instance_data_dir`"
        )
    assert t.dataset is not None
    current = t.dataset.get("instance_data_dir", "s3:///") if source is not None else "s3:///"
    bucket, _, prefix = str(current)[len("s3://") :].partition("/")
    text = str(value).strip().strip("/")
    if entry.key == "aws_bucket_name":
        bucket = text
    else:
        prefix = text
    t.dataset["instance_data_dir"] = f"s3://{bucket}/{prefix}"
    t.sources[slot] = entry.key


def _s3_option(t: Translation, value: Any, entry: DialectKey) -> None:
    """An ``aws_*`` connection key: its ``storage_options`` entry (null / empty: unset, botocore decides)."""
    if is_inert(value):
        t.ignore(f"{t.dataset_label}.{entry.key}", "unset: botocore's default (environment, ~/.aws)")
        return
    assert entry.ours is not None
    t.put(entry.ours, str(value).strip(), entry.key)


def _dataset_path(t: Translation, value: Any, entry: DialectKey) -> None:
    assert entry.ours is not None
    source = t.sources.get(f"{t.dataset_label}.{entry.ours}")
    if source in _S3_LOCATION_KEYS:
        raise Problem(
            f"`{source}` and `{entry.key}` both say where the data is: for `type: aws` give the folder inside the "
            "bucket as `aws_data_prefix` and remove `instance_data_dir`"
        )
    t.put(entry.ours, t.path(value, f"{t.dataset_label}.{entry.key}"), entry.key)


def _caption_strategy(t: Translation, value: Any, entry: DialectKey) -> None:
    choices = CAPTION_STRATEGIES
    ours = spelled(t, value, entry, choices, "captions from text files, file names, the instance prompt or parquet")
    if ours is not None:
        t.put("caption_strategy", ours, entry.key)


def _only_instance_prompt(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        on = as_bool(value, entry.key)
    except Problem as exc:
        t.problems.append(f"{t.dataset_label}: {exc}")
        return
    if on:
        t.put("caption_strategy", "instance_prompt", entry.key)


def _regularisation(t: Translation, value: Any, entry: DialectKey) -> None:
    t.put("is_regularisation_data", plain(value), entry.key)


def _video(t: Translation, value: Any, entry: DialectKey) -> None:
    """SimpleTuner's ``video`` sub-table: ``num_frames`` maps; the rest is refused or ignored by name."""
    if not isinstance(value, dict):
        t.problems.append(f"{t.dataset_label}: `video` must be an object")
        return
    for key, item in value.items():
        where = f"{t.dataset_label}.video.{key}"
        if key == "num_frames":
            t.put("num_frames", plain(item), f"video.{key}")
        elif key == "min_frames":
            t.approx(where, "clips shorter than `num_frames` are skipped; `min_frames` is not read separately")
        elif key == "is_i2v" and not is_inert(item):
            t.problems.append(f"{where}: image-to-video training is not supported yet: remove it")
        elif key in ("is_i2v", "bucket_strategy") and (is_inert(item) or item == "aspect_ratio"):
            t.ignore(where, "its default")
        else:
            t.problems.append(f"{where}: not supported here (clips train on `num_frames` frames from their start)")


def _text_embeds_ref(t: Translation, value: Any, entry: DialectKey) -> None:
    t.report.notes.append(
        f"{t.dataset_label}: `text_embeds: {value}`: text embeddings share one folder here (entries are keyed by "
        "caption and encoder, so sharing changes no embedding)"
    )


def _size(t: Translation, value: Any, entry: DialectKey) -> None:
    """A size filter; SimpleTuner reads 0 (and null) as "not set"."""
    if not is_inert(value):
        t.put(entry.key, plain(value), entry.key)


def _cache_dir_vae(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        return
    t.put("cache_dir_vae", t.path(value, entry.key), entry.key)


def _probability(t: Translation, value: Any, entry: DialectKey) -> None:
    number = plain(value)
    if number == 0:
        t.approx(
            f"{t.dataset_label}.probability",
            "0 leaves the dataset out of training here; SimpleTuner's loader reads a probability of 0 as 1.0",
        )
    t.put("probability", number, entry.key)


def _vae_clear(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        t.ignore(f"{t.dataset_label}.{entry.key}", "off")
        return
    t.approx(
        f"{t.dataset_label}.{entry.key}",
        "latents are not re-encoded each epoch: each image keeps one crop for the whole run (random crops are "
        "drawn once per image from the seed)",
    )


def _conditioning_data(t: Translation, value: Any, entry: DialectKey) -> None:
    """A training dataset's `conditioning_data`: the id of one `dataset_type: conditioning` entry (or a list of
    one); that entry's folder of source images becomes `conditioning_data_dir` (paired by file name)."""
    if is_inert(value):
        return
    ids = [value] if isinstance(value, str) else value
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise Problem(f"`{entry.key}` must be the `id` of a `dataset_type: conditioning` entry (or a list of one)")
    if len(ids) > 1:
        raise Problem(
            f"`{entry.key}` names {len(ids)} conditioning datasets ({', '.join(ids)}): several source images per "
            "sample (Qwen-Image-Edit Plus, multi-reference) are not supported; name one"
        )
    (name,) = ids
    if name not in t.conditioning_sources:
        known = ", ".join(repr(k) for k in t.conditioning_sources) or "none"
        raise Problem(
            f"`{entry.key}`: {name!r} is not the `id` of an enabled `dataset_type: conditioning` entry (those are: "
            f"{known})"
        )
    folder = t.conditioning_sources[name]
    if folder is not None:
        t.put("conditioning_data_dir", folder, f"{entry.key} ({name})")


def _conditioning_entry_key(t: Translation, value: Any, entry: DialectKey) -> None:
    """`conditioning_type` / `source_dataset_id` are read on `dataset_type: conditioning` entries only."""
    t.ignore(f"{t.dataset_label}.{entry.key}", "read on `dataset_type: conditioning` entries only, as in SimpleTuner")


DATASET_CORE: tuple[DialectKey, ...] = (
    _ds("id"),
    _ds("type", apply=_storage),
    _ds("instance_data_dir", note="taken from the working directory, made absolute", apply=_dataset_path),
    _ds(
        "aws_bucket_name",
        "same",
        "instance_data_dir",
        "`type: aws` is `type: object_store` here, its `instance_data_dir` `s3://<aws_bucket_name>/<aws_data_prefix>`",
        apply=_s3_location,
    ),
    _ds(
        "aws_data_prefix",
        "same",
        "instance_data_dir",
        "the folder inside the bucket: `instance_data_dir` `s3://<aws_bucket_name>/<aws_data_prefix>`",
        apply=_s3_location,
    ),
    _ds(
        "aws_endpoint_url", "same", "storage_options.endpoint_url", "null: AWS (or AWS_ENDPOINT_URL)", apply=_s3_option
    ),
    _ds(
        "aws_region_name",
        "same",
        "storage_options.client_kwargs.region_name",
        "null: botocore's region (AWS_REGION / AWS_DEFAULT_REGION, ~/.aws)",
        apply=_s3_option,
    ),
    _ds(
        "aws_access_key_id",
        "same",
        "storage_options.key",
        "null: from the environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws), which is the better place for it",
        apply=_s3_option,
    ),
    _ds(
        "aws_secret_access_key",
        "same",
        "storage_options.secret",
        "null: from the environment (AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws), which is the better place for it",
        apply=_s3_option,
    ),
    _ds("aws_session_token", "same", "storage_options.token", "null: AWS_SESSION_TOKEN", apply=_s3_option),
    _ds("dataset_type", note="`image` or `video`; `text_embeds` entries set the text cache folder"),
    _ds("disabled"),
    _ds("disable", "same", "disabled"),
    _ds(
        "huggingface",
        "unsupported",
        note="Hugging Face Hub datasets are not downloaded by the trainer: download the dataset's Parquet files and "
        "use `type: parquet`",
    ),
    _ds("crop"),
    _ds("crop_style"),
    _ds("crop_aspect"),
    _ds("crop_aspect_buckets"),
    _ds("resolution"),
    _ds("resolution_type"),
    _ds("minimum_image_size", note="0 means unset, as in SimpleTuner", apply=_size),
    _ds("maximum_image_size", note="0 means unset, as in SimpleTuner", apply=_size),
    _ds("target_downsample_size", note="0 means unset, as in SimpleTuner", apply=_size),
    _ds("minimum_aspect_ratio"),
    _ds("maximum_aspect_ratio"),
    _ds("caption_strategy", note="`instanceprompt` -> `instance_prompt`", apply=_caption_strategy),
    _ds("instance_prompt"),
    _ds("prepend_instance_prompt"),
    _ds(
        "only_instance_prompt",
        "same",
        "caption_strategy",
        "true -> `caption_strategy: instance_prompt`",
        apply=_only_instance_prompt,
    ),
    _ds("parquet"),
    _ds("repeats"),
    _ds("probability", apply=_probability),
    _ds("is_regularisation_data", apply=_regularisation),
    _ds("is_regularization_data", "same", "is_regularisation_data", apply=_regularisation),
    _ds("cache_dir_vae", note="`{model_family}` is SimpleTuner's family name; made absolute", apply=_cache_dir_vae),
    _ds("cache_dir", "same", "cache_config.text_cache_dir", "of a `dataset_type: text_embeds` entry"),
    _ds("default", "ignored", note="of a `text_embeds` entry: there is one text cache folder"),
    _ds(
        "text_embeds",
        "approximated",
        "cache_config.text_cache_dir",
        note="every dataset's text embeddings share one folder",
        apply=_text_embeds_ref,
    ),
    _ds("video", "same", "num_frames", "`video.num_frames` -> `num_frames`", apply=_video),
    _ds("vae_cache_clear_each_epoch", "approximated", note="each image keeps one crop for the run", apply=_vae_clear),
    _ds(
        "conditioning_data",
        "same",
        "conditioning_data_dir",
        "Qwen-Image-Edit pairs: the `id` of one `dataset_type: conditioning` entry (or a list of one); its "
        "`instance_data_dir` becomes `conditioning_data_dir` and the entry is not a dataset of its own; several "
        "are not supported (Edit Plus)",
        apply=_conditioning_data,
    ),
    _ds(
        "conditioning_type",
        "same",
        "conditioning_data_dir",
        "of a `dataset_type: conditioning` entry: `reference_strict` (the source takes the edited image's crop) as "
        "there; `reference_loose` approximated (the source is resized to the edited image and takes its crop; "
        "aspect ratios more than 2% apart stop the run); `controlnet`, `mask` and others are not supported",
        apply=_conditioning_entry_key,
    ),
    _ds(
        "source_dataset_id",
        "same",
        "conditioning_data_dir",
        "of a `dataset_type: conditioning` entry: the training dataset whose `conditioning_data` names it",
        apply=_conditioning_entry_key,
    ),
)


TOP_DATASET_KEYS: tuple[DialectKey, ...] = tuple(
    _entry(
        key,
        "same",
        "datasets[].caption_strategy" if key == "only_instance_prompt" else f"datasets[].{key}",
        "each dataset's default, as in SimpleTuner",
    )
    for key in DATASET_DEFAULTS_FROM_TOP
) + (
    _entry(
        "aspect_bucket_rounding",
        "approximated",
        None,
        "aspect ratios are rounded to 2 decimals here (SimpleTuner's default); another value is approximated by 2",
        apply=lambda t, v, e: (
            t.ignore(e.key, "2, as here")
            if plain(v) == 2
            else t.approx(e.key, f"{v!r}: aspect ratios are rounded to 2 decimals here")
        ),
    ),
)
