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
    rename,
    set_spelled,
    spelled,
)


def _ds(key: str, kind: Kind = "same", ours: Optional[str] = None, note: str = "", **kw) -> DialectKey:
    return DialectKey(key, "dataset", kind, ours or (key if kind == "same" else None), note, **kw)


def _storage(t: Translation, value: Any, entry: DialectKey) -> None:
    text = str(value).strip()
    if text in ("local", "in_memory", "huggingface"):
        t.put("type", text, entry.key)
    elif text == "aws":  # the bucket, prefix, endpoint and credentials follow from the `aws_*` keys
        t.put("type", "object_store", entry.key)
    else:
        t.problems.append(f"{t.dataset_label}: `type: {text}` is not supported here: use `type: local`")
    if text == "huggingface" and "caption_column" not in _hub_block(t):
        # SimpleTuner reads a Hub dataset's captions from `huggingface.caption_column`, default `caption`
        # (data_backend/factory.py:3102, metadata/backends/huggingface.py:83)
        t.put("caption_column", "caption", "SimpleTuner's default `huggingface.caption_column`")
        t.report.defaults.append(
            f"`{t.dataset_label}.caption_column: 'caption'` (SimpleTuner's default for a Hub dataset)"
        )


def _is_hub_entry(t: Translation) -> bool:
    return t.dataset_entry is not None and str(t.dataset_entry.get("type", "local")).strip() == "huggingface"


def _hub_block(t: Translation) -> dict[str, Any]:
    block = t.dataset_entry.get("huggingface") if t.dataset_entry is not None else None
    return block if isinstance(block, dict) else {}


def _hub_key(t: Translation, value: Any, entry: DialectKey) -> None:
    """`dataset_name` / `split` / `revision` / `image_column`: read by SimpleTuner for `type: huggingface` only
    (data_backend/config/image.py:167-173), where the entry's own key wins over the `huggingface` block's."""
    if not _is_hub_entry(t):
        t.ignore(f"{t.dataset_label}.{entry.key}", "read for `type: huggingface` entries only, as in SimpleTuner")
        return
    if entry.key == "revision" and is_inert(value):  # null: the default branch, as here
        return
    assert entry.ours is not None
    t.put(entry.ours, value.strip() if isinstance(value, str) else value, entry.key)


_HUB_FILES = "a Hub dataset's files go to the Hub cache (HF_HUB_CACHE / HF_HOME), shared by every run"
_STREAMING = (
    "the split's Parquet files are downloaded, then read in place; SimpleTuner's own documentation says its streaming "
    "does not work"
)


def _cache_dir(t: Translation, value: Any, entry: DialectKey) -> None:
    """`cache_dir`: a `text_embeds` entry's folder (read there); on a `type: huggingface` entry the datasets
    library's cache (data_backend/config/image.py:175), which this trainer does not use."""
    if _is_hub_entry(t):
        t.ignore(f"{t.dataset_label}.{entry.key}", _HUB_FILES)
        return
    rename(t, value, entry)


#: Keys of SimpleTuner's `huggingface` block read here as the entry's own key of the same name.
_HUB_BLOCK_SAME = ("dataset_name", "split", "revision", "image_column")
#: Keys of the `huggingface` block with no effect on what is trained here, and why.
_HUB_BLOCK_IGNORED = {
    "cache_dir": _HUB_FILES,
    "streaming": _STREAMING,
    "num_proc": "worker processes of `filter_func`, which is not supported",
    "auto_load": "when SimpleTuner loads the dataset; here the split is fetched before the run starts",
    "file_extension": "the extension of SimpleTuner's virtual file names; here names come from the rows",
    "width_column": "image sizes are read from the image headers",
    "height_column": "image sizes are read from the image headers",
    "quality_column": "read with `filter_func`'s quality thresholds only",
    "video_column": "read for video datasets only, which a Hub dataset cannot be here",
    "lyrics_column": "audio datasets only",
    "audio_caption_fields": "audio datasets only",
    "num_frames_column": "video datasets only",
    "fps_column": "video datasets only",
}
#: Keys of the `huggingface` block that change what is trained and are not supported, and why.
_HUB_BLOCK_REFUSED = {
    "filter_func": "rows cannot be filtered here: make a filtered copy of the dataset (a Parquet file) and use it",
    "composite_image_config": "cutting one image out of a grid is not supported: crop the images in a copy",
    "fallback_caption_column": "one caption column is read here: fill the empty captions in a copy of the dataset",
    "description_column": "one caption column is read here: fill the empty captions in a copy of the dataset",
    "bbox_column": "grounding boxes are not read here: remove the key",
}


def _huggingface_block(t: Translation, value: Any, entry: DialectKey) -> None:
    """SimpleTuner's `huggingface` block of a `type: huggingface` entry: its caption column (data_backend/
    factory.py:3102, metadata/backends/huggingface.py:83), and the entry's keys it gives where the entry does not
    (data_backend/config/image.py:170-179); the rest is ignored or refused by name."""
    if not isinstance(value, dict):
        raise Problem(f"`{t.dataset_label}.huggingface` must be an object")
    if not _is_hub_entry(t):
        t.ignore(f"{t.dataset_label}.huggingface", "read for `type: huggingface` entries only, as in SimpleTuner")
        return
    assert t.dataset_entry is not None
    for key, item in value.items():
        where = f"{t.dataset_label}.huggingface.{key}"
        if key == "caption_column":
            _hub_caption_column(t, item, where)
        elif key in _HUB_BLOCK_SAME and key in t.dataset_entry:
            t.ignore(where, f"the entry's own `{key}` wins, as in SimpleTuner")
        elif key in _HUB_BLOCK_SAME:
            _hub_key(t, item, DialectKey(key, "dataset", "same", key))
            t.report.mapped.append(f"`{where}` -> `{key}`")
        elif key in _HUB_BLOCK_IGNORED or (key in _HUB_BLOCK_REFUSED and is_inert(item)):
            t.ignore(where, _HUB_BLOCK_IGNORED.get(key, "unset"))
        elif key in _HUB_BLOCK_REFUSED:
            t.problems.append(f"`{where}`: {_HUB_BLOCK_REFUSED[key]}")
        else:
            t.problems.append(f"`{where}`: not a key SimpleTuner reads in the `huggingface` block")


def _hub_caption_column(t: Translation, value: Any, where: str) -> None:
    """`huggingface.caption_column`: one column (a list of one too); several, or a nested `a.b`, are refused."""
    columns = value if isinstance(value, list) else [value]
    if len(columns) != 1 or not isinstance(columns[0], str) or not columns[0]:
        t.problems.append(
            f"`{where}` = {value!r}: one caption column is read here (SimpleTuner keeps a caption per column): name "
            "one, or merge them into one column in a copy of the dataset"
        )
    elif "." in columns[0]:
        t.problems.append(
            f"`{where}` = {columns[0]!r}: a field inside a column is not read here: name a top-level column, or copy "
            "the field into one"
        )
    else:
        t.put("caption_column", columns[0], "huggingface.caption_column")
        t.report.mapped.append(f"`{where}` -> `caption_column`")


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
    if _is_hub_entry(t):  # SimpleTuner gives a Hub dataset no folder (data_backend/builders/huggingface.py:167)
        t.ignore(f"{t.dataset_label}.{entry.key}", "not read for `type: huggingface`, as in SimpleTuner")
        return
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
    text = str(value).strip()
    if _is_hub_entry(t) and text not in ("huggingface", "instanceprompt", "instance_prompt"):
        t.problems.append(  # SimpleTuner refuses them too (data_backend/config/validators.py:139)
            f"{t.dataset_label}: `caption_strategy: {text}` on a `type: huggingface` entry (where unset, the top-level "
            "value or SimpleTuner's default `filename`): SimpleTuner takes `huggingface` (the caption column) or "
            "`instanceprompt` there; set one"
        )
        return
    if text == "huggingface":
        if not _is_hub_entry(t):
            t.problems.append(
                f"{t.dataset_label}: `caption_strategy: huggingface` reads a Hub dataset's caption column: it needs "
                "`type: huggingface`, as in SimpleTuner"
            )
        else:
            t.put("caption_strategy", "textfile", entry.key)  # each row's caption, from `caption_column`
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


#: SimpleTuner's `conditioning` generators this trainer runs (helpers/data_generation/sample_generator.py).
GENERATED_TYPES = ("canny",)


def _conditioning_block(t: Translation, value: Any, entry: DialectKey) -> None:
    """A training dataset's `conditioning` block (a dict, or a list of one): conditioning images generated from its
    own images at start (SimpleTuner's `DatasetDuplicator`, metadata/utils/duplicator.py:170-260)."""
    blocks = value if isinstance(value, list) else [value]
    if len(blocks) != 1 or not isinstance(blocks[0], dict):
        t.problems.append(
            f"{t.dataset_label}.conditioning: one block of generated conditioning images is supported here "
            f"(an object, or a list of one), got {len(blocks) if isinstance(value, list) else type(value).__name__}"
        )
        return
    ours: dict[str, Any] = {}
    for key, item in blocks[0].items():
        where = f"{t.dataset_label}.conditioning.{key}"
        if key == "type":
            if item not in GENERATED_TYPES:
                t.problems.append(
                    f"`{where}: {item}`: only {', '.join(GENERATED_TYPES)} conditioning is generated here: make the "
                    "conditioning images yourself and name their folder in a `dataset_type: conditioning` entry"
                )
            ours["type"] = item
        elif key in ("low_threshold", "high_threshold", "instance_data_dir"):
            ours[key] = t.path(item, where) if key == "instance_data_dir" and isinstance(item, str) else plain(item)
        elif key == "conditioning_type":
            if item not in ("controlnet", "reference_strict"):
                t.problems.append(
                    f"`{where}: {item}`: generated conditioning images follow their image's crop and size here "
                    "(`reference_strict`, `controlnet`); use one of those"
                )
        elif key == "captions":
            t.ignore(
                where,
                "with one conditioning dataset SimpleTuner trains on the images' own captions (collate.py:1031-1036)",
            )
        else:
            t.problems.append(f"`{where}`: not a setting of SimpleTuner's {blocks[0].get('type')} generator")
    if "type" not in ours:
        t.problems.append(f"{t.dataset_label}.conditioning: `type` is missing (e.g. `canny`)")
        return
    t.put("conditioning", ours, entry.key)


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


#: Seconds of video SimpleTuner trains on when `video.num_frames` is left out (data_backend/factory.py:805-812), and
#: the frame rate Wan's check_user_config sets when `framerate` is unset (wan/model.py:1555-1556).
DEFAULT_VIDEO_SECONDS = 5
WAN_DEFAULT_FRAMERATE = 15


def default_video_frames(t: Translation, framerate: Any) -> None:
    """A video dataset without `video.num_frames`: SimpleTuner's rule, with its warning instead of a refusal:
    five seconds at `framerate` (Wan: 15 fps when unset), rounded down to Wan's 8k+1 (wan/model.py:458-464)."""
    rate = plain(framerate)
    rate = rate if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0 else WAN_DEFAULT_FRAMERATE
    frames = rate * DEFAULT_VIDEO_SECONDS
    adjusted = max(1, (frames - 1) // 8 * 8 + 1) if t.our_family == "wan" else frames
    t.put("num_frames", adjusted, "SimpleTuner's default video.num_frames")
    where = "data_backend/factory.py:805-812" + (", wan/model.py:1555" if framerate is None else "")
    rounded = ", rounded down to 8k+1 for Wan, wan/model.py:458-464" if adjusted != frames else ""
    t.report.overridden.append(
        f"`{t.dataset_label}.video.num_frames` left out -> {adjusted}: SimpleTuner trains {DEFAULT_VIDEO_SECONDS} s "
        f"of each clip at {rate} fps ({frames} frames; {where}{rounded}); set `video.num_frames` to train on fewer "
        "frames (less memory)"
    )


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
    """A training dataset's `conditioning_data`: the id of a `dataset_type: conditioning` entry (or a list): the
    folder of one entry of source images becomes `conditioning_data_dir`, of one mask entry (`conditioning_type`
    `mask` / `segmentation`) `mask_data_dir` with that `mask_type`; each paired by file name."""
    if is_inert(value):
        return
    ids = [value] if isinstance(value, str) else value
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise Problem(f"`{entry.key}` must be the `id` of a `dataset_type: conditioning` entry (or a list of them)")
    masks = [name for name in ids if name in t.conditioning_masks]
    sources = [name for name in ids if name not in t.conditioning_masks]
    if len(sources) > 1:
        raise Problem(
            f"`{entry.key}` names {len(sources)} conditioning datasets ({', '.join(sources)}): several source images "
            "per sample (Qwen-Image-Edit Plus, multi-reference) are not supported; name one"
        )
    if len(masks) > 1:
        raise Problem(
            f"`{entry.key}` names {len(masks)} mask datasets ({', '.join(masks)}): SimpleTuner weights the loss by "
            "one of them (collate.py:901); name one"
        )
    if masks and sources:
        t.approx(
            f"{t.dataset_label}.{entry.key}",
            "with Qwen-Image-Edit sources and a mask, SimpleTuner weights the loss by the first conditioning pixels "
            "it collects, the source's (training/collate.py:953-974, models/common.py:4670-4671, 6412); here by the "
            "mask",
        )
    for name in ids:
        if name not in t.conditioning_sources:
            known = ", ".join(repr(k) for k in t.conditioning_sources) or "none"
            raise Problem(
                f"`{entry.key}`: {name!r} is not the `id` of an enabled `dataset_type: conditioning` entry (those "
                f"are: {known})"
            )
        folder = t.conditioning_sources[name]
        if folder is None:
            continue
        if name in t.conditioning_masks:
            t.put("mask_data_dir", folder, f"{entry.key} ({name})")
            t.put("mask_type", t.conditioning_masks[name], f"{entry.key} ({name}).conditioning_type")
        else:
            t.put("conditioning_data_dir", folder, f"{entry.key} ({name})")


def _caption_shuffle(t: Translation, value: Any, entry: DialectKey) -> None:
    """`caption_shuffle` as it is; without its own `seed` SimpleTuner shuffles from the run's `--seed`, and from 0
    when that is unset too (data_backend/factory.py:721-724, prompts.py:237), where the run's seed here is 42."""
    if isinstance(value, dict) and "seed" not in value and is_inert(t.bare.get("seed")):
        value = {**value, "seed": 0}
        t.report.defaults.append(f"`{t.dataset_label}.caption_shuffle.seed: 0` (SimpleTuner's, with no `seed` set)")
    t.put(entry.key, value, entry.key)


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
        "dataset_name",
        note="`type: huggingface`: the dataset's repo id (the `huggingface` block's where unset here)",
        apply=_hub_key,
    ),
    _ds("split", note="`type: huggingface`: the split read, `train` by default; a name, not a slice", apply=_hub_key),
    _ds("revision", note="`type: huggingface`: branch, tag or commit; null: `main`", apply=_hub_key),
    _ds("image_column", note="`type: huggingface`: the column of images, `image` by default", apply=_hub_key),
    _ds(
        "caption_column",
        "ignored",
        note="SimpleTuner reads a Hub dataset's captions from `huggingface.caption_column` (default `caption`), not "
        "from this key",
    ),
    _ds("video_column", "ignored", note="`type: huggingface`: " + _HUB_BLOCK_IGNORED["video_column"]),
    _ds("streaming", "ignored", note=f"`type: huggingface`: {_STREAMING}"),
    _ds("num_proc", "ignored", note="`type: huggingface`: " + _HUB_BLOCK_IGNORED["num_proc"]),
    _ds("auto_load", "ignored", note="`type: huggingface`: " + _HUB_BLOCK_IGNORED["auto_load"]),
    _ds(
        "split_composite_images",
        "unsupported",
        note="`type: huggingface`: cutting grid images into several samples is not supported",
    ),
    _ds("composite_image_column", "ignored", note="read with `split_composite_images` only"),
    _ds(
        "huggingface",
        "same",
        "caption_column",
        "`type: huggingface`: `caption_column` (one column, default `caption`); `dataset_name` / `split` / `revision` "
        "/ `image_column` where the entry does not set them; `filter_func`, `composite_image_config`, "
        "`fallback_caption_column` / `description_column` refused; loader settings (`cache_dir`, `streaming`, "
        "`num_proc`, ...) ignored. An empty caption falls back as a missing caption file does (SimpleTuner tries a "
        "`description` column first)",
        apply=_huggingface_block,
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
    _ds(
        "caption_strategy",
        note="`instanceprompt` -> `instance_prompt`; `huggingface` (a `type: huggingface` entry's caption column) -> "
        "`textfile`, and such an entry takes no other than these two, as in SimpleTuner",
        apply=_caption_strategy,
    ),
    _ds(
        "disable_multiline_split",
        note="false (the default): a caption file of several lines gives one line per step, drawn from the seed",
        apply=lambda t, v, e: t.put(e.key, as_bool(v, f"{t.dataset_label}.{e.key}"), e.key),
    ),
    _ds("instance_prompt"),
    _ds("prepend_instance_prompt"),
    _ds(
        "caption_shuffle",
        note="`enable`, `count`, `seed` (unset: the run's `seed`, 0 without one), `split_on`, `position_start`, "
        "`include_original`: the same shuffled copies, each encoded once, one drawn per use",
        apply=_caption_shuffle,
    ),
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
    _ds(
        "cache_dir",
        "same",
        "cache_config.text_cache_dir",
        "of a `dataset_type: text_embeds` entry; on a `type: huggingface` entry ignored (the Hub cache is used)",
        apply=_cache_dir,
    ),
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
        "the `id` of a `dataset_type: conditioning` entry (or a list): edit sources (Qwen-Image-Edit, Flux Kontext's "
        "references) and a ControlNet's conditioning images, whose `instance_data_dir` becomes "
        "`conditioning_data_dir` (several are not supported: Edit Plus, multi-reference), and masks "
        "(`conditioning_type` `mask` / `segmentation`), whose folder becomes `mask_data_dir`; the entry is not a "
        "dataset of its own",
        apply=_conditioning_data,
    ),
    _ds(
        "conditioning",
        "same",
        "conditioning",
        "generated conditioning images (one block): `type: canny` with `low_threshold` / `high_threshold` (imageproc's "
        "Canny, as SimpleTuner's generator runs it) and `instance_data_dir`; `conditioning_type` `controlnet` / "
        "`reference_strict` (the image's crop); `captions` ignored (one conditioning dataset trains on the images' "
        "captions); other generators are not supported",
        apply=_conditioning_block,
    ),
    _ds(
        "conditioning_type",
        "same",
        "conditioning_data_dir",
        "of a `dataset_type: conditioning` entry: `reference_strict` (the source takes the edited image's crop) as "
        "there; `reference_loose` approximated (the source is resized to the edited image and takes its crop; "
        "aspect ratios more than 2% apart stop the run); `mask` / `segmentation` -> `mask_type` of the dataset "
        "whose `mask_data_dir` it becomes (approximated: the mask is resized with area averaging, not Lanczos); "
        "`controlnet` (or unset) with `controlnet: true`: the ControlNet's conditioning images, each taking its "
        "image's crop and size as there (collate.py:255-290); others are not supported",
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
