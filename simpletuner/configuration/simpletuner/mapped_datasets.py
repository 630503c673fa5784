"""What each key of a SimpleTuner dataset entry means here (``DATASET_CORE``), and the top-level keys that
are each dataset's default (``TOP_DATASET_KEYS``).
"""

from __future__ import annotations

from typing import Any, Optional

from simpletuner.configuration.simpletuner.facts import (
    CAPTION_STRATEGIES,
    CROP_STYLES,
    DATASET_DEFAULTS_FROM_TOP,
)
from simpletuner.configuration.simpletuner.reading import (
    DialectKey,
    Kind,
    Problem,
    Translation,
    as_bool,
    is_inert,
    key_row,
    plain,
    set_spelled,
    spelled,
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
    if entry.key == "aws_region_name" and t.dataset_entry is not None:
        endpoint = t.dataset_entry.get("aws_endpoint_url", t.dataset_entry.get("--aws_endpoint_url"))
        if not is_inert(endpoint):  # SimpleTuner drops the region when an endpoint is set (data_backend/aws.py:86-89)
            t.ignore(f"{t.dataset_label}.{entry.key}", "SimpleTuner does not pass the region with an endpoint set")
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
    own = t.dataset_entry.get("only_instance_prompt") if t.dataset_entry is not None else None
    if own is not None and as_bool(own, f"{t.dataset_label}.only_instance_prompt"):
        t.ignore(f"{t.dataset_label}.{entry.key}", "`only_instance_prompt` wins, as in SimpleTuner")
        return
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
    if on:  # it wins over `caption_strategy`: SimpleTuner stops reading captions (factory.py:3519-3522)
        assert t.dataset is not None
        t.dataset["caption_strategy"] = "instance_prompt"
        t.sources[f"{t.dataset_label}.caption_strategy"] = entry.key


def _dataset_bool(t: Translation, value: Any, entry: DialectKey) -> None:
    """A dataset switch. SimpleTuner's dataset reader takes `bool(value)` (factory.py:1175, config/image.py:116,
    121, 239), so any non-empty string, `"false"` too, is on there: a string is refused, naming the fix."""
    if isinstance(value, str):
        raise Problem(
            f"`{t.dataset_label}.{entry.key}` = {value!r}: SimpleTuner's dataset reader takes any non-empty string as "
            'true (even "false"); write true or false without quotes'
        )
    assert entry.ours is not None
    t.put(entry.ours, value, entry.key)


_DOWNSAMPLE = (
    "images above the maximum are downsampled here, as SimpleTuner's documentation says; its code resizes nearly "
    "every image when both are set (training_sample.py:452-475)"
)


_ASPECT_FILTER = (
    "compares each image's own aspect ratio; SimpleTuner drops whole buckets by the bucket's aspect "
    "(metadata/backends/base.py:1039-1080), so under square crops it keeps every image"
)


def _parquet(t: Translation, value: Any, entry: DialectKey) -> None:
    """The `parquet` block, with SimpleTuner's column defaults (factory.py:942-944) where it leaves them out."""
    if not isinstance(value, dict):
        raise Problem(f"`{t.dataset_label}.parquet` must be an object")
    block = dict(value)
    for key, default in (("filename_column", "id"), ("caption_column", "description")):
        if key not in block:
            block[key] = default
            t.report.defaults.append(f"`{t.dataset_label}.parquet.{key}: {default!r}` (SimpleTuner's default)")
    t.put("parquet", block, entry.key)


def _video(t: Translation, value: Any, entry: DialectKey) -> None:
    """SimpleTuner's ``video`` sub-table: ``num_frames`` maps; the rest is refused or ignored by name."""
    if not isinstance(value, dict):
        t.problems.append(f"{t.dataset_label}: `video` must be an object")
        return
    for key, item in value.items():
        where = f"{t.dataset_label}.video.{key}"
        if key == "num_frames":
            frames = plain(item)
            if t.our_family == "wan" and isinstance(frames, int) and frames >= 1 and frames % 8 != 1:
                adjusted = max(1, (frames - 1) // 8 * 8 + 1)  # Wan's adjust_video_frames (wan/model.py:458-464)
                t.report.overridden.append(
                    f"`{where}: {frames}` -> {adjusted}: SimpleTuner rounds a Wan clip down to 8k+1 frames "
                    "(wan/model.py:458-464, data_backend/factory.py:867-889), so this run does too"
                )
                frames = adjusted
            t.put("num_frames", frames, f"video.{key}")
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
    _ds("disabled", apply=_dataset_bool),
    _ds("disable", "same", "disabled"),
    _ds(
        "huggingface",
        "unsupported",
        note="Hugging Face Hub datasets are not downloaded by the trainer: download the dataset's Parquet files and "
        "use `type: parquet`",
    ),
    _ds("crop", apply=_dataset_bool),
    _ds(
        "crop_style",
        note="`centre` -> `center`; `face` (OpenCV face-centred crops) is not supported",
        apply=set_spelled(CROP_STYLES, "random, center or corner crops"),
    ),
    _ds("crop_aspect"),
    _ds("crop_aspect_buckets"),
    _ds("resolution"),
    _ds("resolution_type"),
    _ds("minimum_image_size", note="0 means unset, as in SimpleTuner", apply=_size),
    _ds("maximum_image_size", "approximated", "maximum_image_size", _DOWNSAMPLE, apply=_size),
    _ds("target_downsample_size", "approximated", "target_downsample_size", _DOWNSAMPLE, apply=_size),
    _ds("minimum_aspect_ratio", "approximated", "minimum_aspect_ratio", _ASPECT_FILTER),
    _ds("maximum_aspect_ratio", "approximated", "maximum_aspect_ratio", _ASPECT_FILTER),
    _ds("caption_strategy", note="`instanceprompt` -> `instance_prompt`", apply=_caption_strategy),
    _ds(
        "disable_multiline_split",
        note="false (the default): a caption file of several lines gives one line per step, drawn from the seed",
        apply=lambda t, v, e: t.put(e.key, as_bool(v, f"{t.dataset_label}.{e.key}"), e.key),
    ),
    _ds("instance_prompt"),
    _ds("prepend_instance_prompt"),
    _ds(
        "only_instance_prompt",
        "same",
        "caption_strategy",
        "true -> `caption_strategy: instance_prompt`",
        apply=_only_instance_prompt,
    ),
    _ds(
        "parquet",
        note="`filename_column` / `caption_column` default to SimpleTuner's `id` / `description` (factory.py:942-944)",
        apply=_parquet,
    ),
    _ds("repeats"),
    _ds(
        "probability",
        "approximated",
        "probability",
        "each dataset is weighted by probability x its batches for the whole epoch; in SimpleTuner a dataset that "
        "runs out leaves the draw until all have, and one of its readers turns 0 into 1.0",
        apply=_probability,
    ),
    _ds("is_regularisation_data", apply=_dataset_bool),
    _ds("is_regularization_data", "same", "is_regularisation_data", apply=_dataset_bool),
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
    key_row(
        key,
        "approximated" if key in ("maximum_image_size", "target_downsample_size") else "same",
        "datasets[].caption_strategy" if key == "only_instance_prompt" else f"datasets[].{key}",
        f"each dataset's default, as in SimpleTuner; {_DOWNSAMPLE}"
        if key in ("maximum_image_size", "target_downsample_size")
        else "true holds for every dataset, whatever its own value (SimpleTuner ORs them)"
        if key == "only_instance_prompt"
        else "each dataset's default, as in SimpleTuner",
    )
    for key in DATASET_DEFAULTS_FROM_TOP
) + (
    key_row(
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
