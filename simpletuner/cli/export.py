"""``simpletuner export OUTPUT_DIR --format kohya|comfyui [--out FILE] [--checkpoint N]``: a finished run's adapter
under the key names kohya-ss' trainers or ComfyUI use.

Reads the run's final adapter (the files ``final_weights.json`` lists; with ``--checkpoint N`` the adapter in
``checkpoint-N``) and its ``config.json`` (model family, adapter kind), and writes ``<name>.<format>.safetensors``
beside each adapter file (Wan 2.2: one per expert), or ``--out``. What each format holds per family, and the formats
a family has not (said in one line, exit 2): documentation/MODEL_FAMILIES.md, "Exporting the adapter". The config's
``output_formats`` writes the same files at the end of a run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from simpletuner.cli.arguments import add_log_level_argument
from simpletuner.configuration.export_formats import EXPORT_FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", help="the run's output folder (it holds config.json and final_weights.json)")
    parser.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="the key names to write")
    parser.add_argument(
        "--out",
        help="the file to write (default: beside the adapter, <name>.<format>.safetensors); a run with one adapter "
        "file only",
    )
    parser.add_argument(
        "--checkpoint", type=int, metavar="N", help="export the adapter of checkpoint-N instead of the final one"
    )
    add_log_level_argument(parser)


def run(args: argparse.Namespace) -> int:
    from simpletuner.exit_codes import BAD_INPUT, OK
    from simpletuner.training.runlog import configure_logging

    configure_logging(args.log_level)
    try:
        written = export_run(Path(args.output_dir), args.format, args.out, args.checkpoint)
    except ValueError as exc:  # ExportError, ConfigError, a folder without an adapter: one line says what
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    for path in written:
        print(f"wrote {path}")
    return OK


def export_run(output_dir: Path, fmt: str, out: str | None = None, checkpoint: int | None = None) -> list[Path]:
    """Write the adapter of the run in ``output_dir`` (its final one, or ``checkpoint-N``'s) as ``fmt``; returns the
    files written.

    Raises:
        ValueError: the run's config cannot be read; the run has no adapter this format can hold (a full fine-tune,
            LyCORIS, DoRA, a family without the format); no final adapter or no such checkpoint; ``out`` with
            several adapter files; a module the format's readers would map elsewhere (ExportError).
    """
    from simpletuner.cli.push import read_run_config
    from simpletuner.configuration.export_formats import export_problem
    from simpletuner.models.adapters.export import export_file, export_name
    from simpletuner.models.adapters.lora_names import NEEDS_DENOISER_CONFIG

    config, raw = read_run_config(output_dir)
    family = config.model_family
    problem = export_problem(family, fmt, config.training_type, config.lora_type, config.lora_use_dora)
    if problem:
        raise ValueError(problem)
    sources = _adapter_files(output_dir, checkpoint)
    if out is not None and len(sources) != 1:
        names = ", ".join(p.name for p in sources)
        raise ValueError(f"--out names one file, and this run has {len(sources)} adapter files ({names}): leave it out")
    denoiser_config = _denoiser_config(config, raw) if (family, fmt) in NEEDS_DENOISER_CONFIG else None
    targets = [Path(out)] if out is not None else [p.with_name(export_name(p.name, fmt)) for p in sources]
    return [export_file(src, dst, family, fmt, denoiser_config) for src, dst in zip(sources, targets)]


def _adapter_files(output_dir: Path, checkpoint: int | None) -> list[Path]:
    """The diffusers-format adapter files of the final save (``final_weights.json``) or of ``checkpoint-N``."""
    from simpletuner.configuration.export_formats import export_format_of
    from simpletuner.training.checkpoint import is_complete
    from simpletuner.training.publish import ADAPTER_FILES, read_final_record

    if checkpoint is None:
        _, names = read_final_record(output_dir)
        found = [output_dir / name for name in names]
        where = f"the final weights of {output_dir}"
    else:
        folder = output_dir / f"checkpoint-{checkpoint}"
        if not is_complete(folder):
            raise ValueError(f"{folder} is not a complete checkpoint")
        found = sorted(folder.iterdir())
        where = str(folder)
    adapters = [
        p
        for p in found
        if p.is_file()
        and ADAPTER_FILES.match(p.name)
        and export_format_of(p.name) is None
        and p.suffix == ".safetensors"
    ]
    if not adapters:
        raise ValueError(f"{where} hold no adapter file (pytorch_lora_weights*.safetensors)")
    return adapters


def _denoiser_config(config: Any, raw: dict) -> dict[str, Any] | None:
    """The denoiser's ``config.json`` from the run's model (a local folder, or a hub id's configs in the Hub cache,
    fetched when online); None where it cannot be had (the exporter then says what it needed)."""
    import json

    from simpletuner.configuration.families import FAMILIES
    from simpletuner.hub import HubError, resolve_config_model

    subfolder = "unet" if "unet" in FAMILIES[config.model_family].components else "transformer"
    try:
        snapshot = resolve_config_model(raw)
    except HubError:
        return None
    root = snapshot.folder if snapshot is not None else Path(config.pretrained_model_name_or_path).expanduser()
    try:
        found = json.loads((root / subfolder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
