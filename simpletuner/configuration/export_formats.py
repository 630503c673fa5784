"""The adapter file formats a run can write besides diffusers' (``output_formats``, ``simpletuner export``), and
which family / run can have which: one table the config rule, the exporter and the command share.

``kohya``: the names kohya-ss' trainers write (sd-scripts for sd / sdxl / flux, musubi-tuner for wan / qwen_image),
with an ``.alpha`` per module. ``comfyui``: the names ComfyUI's LoRA loader maps for the family. Each is written only
where diffusers' own ``load_lora_weights`` reads it back to the same weights (tests/test_export.py); the others are
refused with the reason. documentation/MODEL_FAMILIES.md, "Exporting the adapter".
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Literal, get_args

#: What ``simpletuner export --format`` writes.
ExportFormat = Literal["kohya", "comfyui"]
EXPORT_FORMATS: tuple[str, ...] = get_args(ExportFormat)
#: What ``output_formats`` lists: the diffusers file (always written) and the exports beside it.
OutputFormat = Literal["diffusers", "kohya", "comfyui"]
OUTPUT_FORMATS: tuple[str, ...] = get_args(OutputFormat)

#: An exported file's name: the diffusers file's stem, the format, ``.safetensors``.
_EXPORT_NAME = re.compile(r"\.(kohya|comfyui)\.safetensors$")


def export_format_of(name: str) -> str | None:
    """The format an exported file's name says (``x.comfyui.safetensors``: comfyui); None for any other file."""
    match = _EXPORT_NAME.search(name)
    return match.group(1) if match else None


#: (family, format) with no such naming that diffusers reads back, and what to use instead (one line each).
NOT_WRITTEN: dict[tuple[str, str], str] = {
    ("sd3", "kohya"): (
        "sd3 has no kohya-named LoRA that diffusers reads back (SD3LoraLoaderMixin converts none), so none is "
        "written; the comfyui format is the file ComfyUI loads for sd3"
    ),
}


def export_problem(family: str, fmt: str, training_type: str, lora_type: str, use_dora: bool) -> str | None:
    """Why a run of ``family`` cannot have its adapter written as ``fmt`` (one line); None when it can."""
    if fmt not in EXPORT_FORMATS:
        return f"{fmt!r} is not an export format ({', '.join(EXPORT_FORMATS)})"
    if training_type != "lora":
        return "a full fine-tune is saved as a diffusers model folder; kohya / ComfyUI files are written for LoRAs"
    if lora_type == "lycoris":
        return (
            "a LyCORIS adapter is already saved in LyCORIS' own naming (`lycoris_<module>` keys, which ComfyUI maps "
            "for sd, sdxl, sd3, flux and qwen_image); export renames peft LoRAs (lora_type standard)"
        )
    if use_dora:
        return "a DoRA adapter (lora_use_dora) has a magnitude per channel that these formats do not carry"
    return NOT_WRITTEN.get((family, fmt))


def output_formats_problems(cfg: Any) -> Iterator[str]:
    """Config rule: ``output_formats`` keeps ``diffusers`` and names formats this run's adapter can be written in."""
    formats = [fmt for fmt in cfg.output_formats if fmt in OUTPUT_FORMATS]  # the schema names any other entry
    if "diffusers" not in formats:
        yield (
            "output_formats must keep 'diffusers': the final adapter is always written in diffusers' format (exports, "
            "uploads and the model card read it); list the other formats beside it, e.g. ['diffusers', 'comfyui']"
        )
    if len(set(formats)) != len(formats):
        yield f"output_formats lists a format twice: {formats}"
    for fmt in dict.fromkeys(f for f in formats if f != "diffusers"):
        problem = export_problem(cfg.model_family, fmt, cfg.training_type, cfg.lora_type, cfg.lora_use_dora)
        if problem:
            yield f"output_formats {fmt!r}: {problem}"
