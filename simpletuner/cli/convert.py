"""``simpletuner convert SRC [--out native.json]``: a SimpleTuner config or an ai-toolkit job written as a native one.

The translation is the one ``train`` and ``estimate`` apply when they are given a SimpleTuner config
(simpletuner/configuration/simpletuner/) or an ai-toolkit job file, YAML or JSON (configuration/aitoolkit/): the
same mapping report is printed, datasets from ``data_backend_config`` are inlined, and paths (which both tools read
from the working directory) are written absolute, so training the converted file is the same run as training the
original. The translation is validated as a native config before anything is written: convert writes only what loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write a SimpleTuner config (config.json with its multidatabackend.json) or an ai-toolkit job file (YAML or "
        "JSON, one trainer process) as a native config and print what each key became. Run it from the folder you "
        "run that tool from: its paths are relative to it."
    )
    parser.add_argument("source", metavar="SRC", help="SimpleTuner config.json, or an ai-toolkit job (.yaml / .json)")
    parser.add_argument("--out", help="write the native config here (default: print it)")
    parser.add_argument("--force", action="store_true", help="overwrite --out when it exists (default: refuse)")


def run(args: argparse.Namespace) -> int:
    from simpletuner.configuration.aitoolkit import translate as ait
    from simpletuner.configuration.errors import ConfigError
    from simpletuner.configuration.loader import NATIVE_KEYS, read_config_file, validate_config
    from simpletuner.configuration.simpletuner import translate as dialect
    from simpletuner.configuration.simpletuner.reading import Report

    source = Path(args.source)
    try:
        raw = read_config_file(source)
        if not isinstance(raw, dict):
            raise ConfigError(["the config must be a JSON object ({...})"], str(source))
        report: Report
        if ait.looks_like_ai_toolkit(raw):
            native, report = ait.translate(raw, source)
        elif dialect.looks_like_simpletuner(raw, NATIVE_KEYS):
            native, report = dialect.translate(raw, source)
        else:
            print(
                f"{source} is already a native config (neither a SimpleTuner key nor an ai-toolkit job in it): nothing "
                "to convert",
                file=sys.stderr,
            )
            return 2
    except dialect.DialectError as exc:
        print(ConfigError(exc.problems, exc.source), file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    for line in report.lines():
        print(line, file=sys.stderr)
    try:  # write only what loads (files are not looked for: the run may be meant for another machine)
        validate_config(native, base_dir=source.parent, source=f"{source} (translated)", check_files=False)
    except ConfigError as exc:
        print(f"{exc}\nnothing written: the translation does not load as a native config", file=sys.stderr)
        return 2
    for line in report.approximated:
        print(f"warning: approximated: {line}", file=sys.stderr)
    for line in report.overridden:
        print(f"warning: forced as in the source tool: {line}", file=sys.stderr)
    text = json.dumps(native, indent=2, ensure_ascii=False) + "\n"
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"{out} exists: choose another --out, or add --force to overwrite it", file=sys.stderr)
        return 2
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    print(f"wrote {out}: train it with `simpletuner train --config {out}`", file=sys.stderr)
    return 0
