"""An ai-toolkit job's ``datasets`` (or the GH200 fork's one ``dataset``) -> our dataset entries: one per resolution
of a resolution list (as ai-toolkit splits them, toolkit/config_modules.py:1095-1113), captions from ``.txt`` files
read whole, and the keys ai-toolkit reads once per dataset that are one top-level setting here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

from simpletuner.configuration.simpletuner.reading import plain

if TYPE_CHECKING:
    from simpletuner.configuration.aitoolkit.translate import Job

#: Keys read by :func:`_entry` itself.
_OWN = {
    "folder_path",
    "caption_ext",
    "caption_type",
    "caption_dropout_rate",
    "shuffle_tokens",
    "cache_latents_to_disk",
    "cache_latents",
    "resolution",
    "num_repeats",
    "num_frames",
    "trigger_word",
    "default_caption",
    "control_path",
    "buckets",
    "bucket_tolerance",
    "augmentations_cache_mode",
    "type",
    "is_reg",
}

#: Copies of each caption our `caption_shuffle` encodes for ai-toolkit's `shuffle_tokens`.
SHUFFLED_COPIES = 8


def datasets(job: "Job", process: Mapping[str, Any], train: Mapping[str, Any], trigger: Optional[str]) -> None:  # noqa: C901
    """Write ``job.out["datasets"]`` and the top-level keys ai-toolkit sets per dataset."""
    entries = process.get("datasets")
    if "dataset" in process:  # the GH200 fork's one-dataset block (seed 001, 8.3)
        if entries is not None:
            job.stop("dataset", "the job also has `datasets`: keep one of them")
            return
        entries = [process["dataset"]]
        job.report.mapped.append("`dataset` -> `datasets[0]`")
    if not isinstance(entries, list) or not entries:
        job.stop("datasets", "must list at least one dataset (`folder_path`, ...)")
        return
    out: list[dict[str, Any]] = []
    tops: dict[str, dict[str, Any]] = {}
    text_cached = bool(train.get("cache_text_embeddings"))
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            job.stop(f"datasets[{i}]", "must be a mapping of the dataset's keys")
            continue
        resolutions = entry.get("resolution", 512)
        listed = resolutions if isinstance(resolutions, list) else [resolutions]
        for resolution in listed:
            one = _entry(
                job,
                entry,
                i,
                plain(resolution),
                len(listed) > 1,
                tops,
                text_cached or bool(entry.get("cache_text_embeddings")),
                trigger,
            )
            if one is not None:
                one["id"] = f"dataset{i}-{plain(resolution)}" if len(listed) > 1 else f"dataset{i}"
                out.append(one)
        if "resolution" in entry:
            job.approx(f"datasets[{i}].resolution", job_note("resolution"))
    for ours, by_value in tops.items():
        if len(by_value) > 1:
            where = ", ".join(f"{v!r} ({w})" for v, w in by_value.items())
            job.stop(ours, f"is one setting for every dataset here, and the datasets differ: {where}")
        elif by_value:
            node = job.out
            *parents, last = ours.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = next(iter(by_value))
    job.out["datasets"] = out


def job_note(key: str) -> str:
    from simpletuner.configuration.aitoolkit.table import row_for

    row = row_for("dataset", key)
    return row.note if row is not None else ""


def _entry(  # noqa: PLR0913
    job: "Job",
    entry: dict[str, Any],
    index: int,
    resolution: Any,
    split: bool,
    tops: dict[str, dict[str, Any]],
    text_cached: bool,
    trigger: Optional[str],
) -> Optional[dict[str, Any]]:
    """One ai-toolkit dataset entry at one ``resolution`` -> our dataset entry (None when it names no folder); the
    run-wide values it sets go into ``tops`` (key -> {value: where from})."""
    label = f"datasets[{index}]"
    ours = _files(job, entry, label, resolution)
    if ours is None:
        return None
    _captions(job, entry, label, ours, trigger)
    _pairs_and_refusals(job, entry, label, ours)
    _run_wide(job, entry, label, tops, text_cached)
    if not split:
        job.report.mapped.append(f"`{label}` -> `datasets[{index}]`")
    for key, value in entry.items():
        if key not in _OWN:
            from simpletuner.configuration.aitoolkit.translate import _generic

            _generic(job, "dataset", key, value, f"{label}.{key}", ours)
    return ours


def _files(job: "Job", entry: dict[str, Any], label: str, resolution: Any) -> Optional[dict[str, Any]]:
    """The folder, caption files, resolution, repeats and frames of the entry; None without a folder."""
    ours: dict[str, Any] = {"type": "local"}
    folder = entry.get("folder_path")
    if not isinstance(folder, str) or not folder:
        job.stop(f"{label}.folder_path", "must name the folder of images (`dataset_path` is not read here)")
        return None
    ours["instance_data_dir"] = job.path(folder)
    if entry.get("type", "image") != "image":
        job.stop(f"{label}.type", f"{entry['type']!r}: only image datasets train here")
    ext = str(entry.get("caption_type", entry.get("caption_ext", ".txt"))).lstrip(".")
    if ext != "txt":
        job.stop(f"{label}.caption_ext", f"{ext!r}: captions are read from .txt files here; rename them")
    ours["caption_strategy"] = "textfile"
    ours["disable_multiline_split"] = True  # ai-toolkit's clean_caption keeps the whole file (dataloader_mixins.py:99)
    ours["resolution"] = resolution
    repeats = plain(entry.get("num_repeats", 1))
    if isinstance(repeats, int) and repeats >= 1:
        ours["repeats"] = repeats - 1
    else:
        job.stop(f"{label}.num_repeats", f"{repeats!r}: a whole number of at least 1")
    frames = plain(entry.get("num_frames", 1))
    if isinstance(frames, int) and frames > 1:
        ours["dataset_type"] = "video"
        ours["num_frames"] = frames
        job.approx(f"{label}.num_frames", job_note("num_frames"))
    return ours


def _captions(job: "Job", entry: dict[str, Any], label: str, ours: dict[str, Any], trigger: Optional[str]) -> None:
    """The trigger word, `default_caption`, `unload_text_encoder`'s trigger-only captions and token shuffling."""
    word = entry.get("trigger_word", trigger)
    default_caption = entry.get("default_caption")
    trigger_only = job.out.get("__trigger_only__") and not entry.get("cache_text_embeddings")
    if trigger_only and word:  # the trigger word's embedding for every image (SDTrainer.py:1679-1688)
        ours["caption_strategy"] = "instance_prompt"
        ours["instance_prompt"] = word
    elif trigger_only:
        job.stop(
            "train.unload_text_encoder",
            "without a trigger word ai-toolkit trains every image on the empty prompt (SDTrainer.py:1679), which "
            "is not trained here: set `trigger_word`, or remove `unload_text_encoder` to train on the captions",
        )
    elif word:
        ours["instance_prompt"] = word
        ours["prepend_instance_prompt"] = True
        job.approx(f"{label}.trigger_word" if "trigger_word" in entry else "trigger_word", job_note("trigger_word"))
    elif isinstance(default_caption, str):
        ours["instance_prompt"] = default_caption
        job.approx(f"{label}.default_caption", job_note("default_caption"))
    if entry.get("shuffle_tokens"):
        ours["caption_shuffle"] = {"enable": True, "count": SHUFFLED_COPIES, "split_on": "comma"}
        job.approx(f"{label}.shuffle_tokens", job_note("shuffle_tokens"))


def _pairs_and_refusals(job: "Job", entry: dict[str, Any], label: str, ours: dict[str, Any]) -> None:
    """`control_path` (edit sources), and what the entry asks that is not trained here."""
    control = entry.get("control_path")
    if isinstance(control, str) and control:
        ours["conditioning_data_dir"] = job.path(control)
        job.approx(f"{label}.control_path", job_note("control_path"))
    elif control:
        job.stop(f"{label}.control_path", "one folder of source images only here")
    if entry.get("buckets", True) is not True:
        job.stop(f"{label}.buckets", "aspect bucketing is always on here: remove it")
    if entry.get("is_reg"):
        job.stop(
            f"{label}.is_reg",
            "ai-toolkit trains regularisation images like the others, weighted by `reg_weight`; here "
            "`is_regularisation_data` trains them toward the base model's own prediction: remove it, or use a native "
            "config with `is_regularisation_data`",
        )


def _run_wide(
    job: "Job", entry: dict[str, Any], label: str, tops: dict[str, dict[str, Any]], text_cached: bool
) -> None:
    """The entry's settings that are run-wide keys here (caption dropout, bucket tolerance, augmentation cache
    mode, where latents are cached): recorded in ``tops`` for the caller to reconcile across entries."""
    rate = plain(entry.get("caption_dropout_rate", 0.0))
    if text_cached and rate:
        note = (
            f"`{label}.caption_dropout_rate: {rate}` -> 0: ai-toolkit never drops captions whose embeddings are "
            "cached (`cache_text_embeddings`, dataloader_mixins.py:403)"
        )
        if note not in job.report.notes:
            job.report.notes.append(note)
        rate = 0.0
    tops.setdefault("caption_dropout_probability", {}).setdefault(rate, f"{label}.caption_dropout_rate")
    tolerance = entry.get("bucket_tolerance")
    if tolerance is not None:
        tops.setdefault("aspect_bucket_alignment", {}).setdefault(plain(tolerance), f"{label}.bucket_tolerance")
    mode = entry.get("augmentations_cache_mode")
    if mode is not None:
        tops.setdefault("augmentations_cache_mode", {}).setdefault(mode, f"{label}.augmentations_cache_mode")
    in_memory = entry.get("cache_latents") and entry.get("cache_latents_to_disk") is False
    tops.setdefault("cache_config.vae_cache_type", {}).setdefault(
        "memory" if in_memory else "disk", f"{label}.cache_latents"
    )
