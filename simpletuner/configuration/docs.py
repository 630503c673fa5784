"""Generate documentation/CONFIG.md from the schema: ``python -m simpletuner.configuration.docs``.

A test regenerates it and compares, so the reference never drifts from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from simpletuner.configuration.schema import (
    CacheConfig,
    GH200Optimizations,
    InMemoryDatasetConfig,
    InMemoryOptions,
    LocalDatasetConfig,
    TrainingConfig,
)

HEADER = """# Configuration reference

A run is configured by one JSON file: `simpletuner train --config cfg.json` or
`accelerate launch simpletuner/train.py --config cfg.json`. Unknown keys are rejected and
every problem is reported at once, with its path and the fix, before any model loads.
Any key can be overridden on the command line: `--set max_train_steps=100`,
`--set cache_config.cache_dir=/scratch/cache` (values are parsed as JSON when they can be).

This file is generated from `simpletuner/configuration/schema.py` by
`python -m simpletuner.configuration.docs`; a test fails when they differ.
"""


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return "object"
        return getattr(annotation, "__name__", str(annotation))
    args = [a for a in get_args(annotation) if a is not type(None)]
    name = getattr(origin, "__name__", str(origin))
    if name == "Literal":
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if name in ("Union", "UnionType", "Optional"):
        return " \\| ".join(_type_name(a) for a in args)
    if name == "Annotated":
        return _type_name(args[0])
    if name == "list":
        return f"list of {_type_name(args[0])}" if args else "list"
    return name


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    if field.default_factory is not None:
        return "(object)"
    return "`null`" if field.default is None else f"`{field.default!r}`".replace("'", '"')


def model_table(model: type[BaseModel]) -> str:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
    return "\n".join(rows)


def render() -> str:
    parts = [
        HEADER,
        "## Top-level keys\n",
        model_table(TrainingConfig),
        "\n## `cache_config`\n",
        model_table(CacheConfig),
        "\n## `gh200_optimizations`\n",
        model_table(GH200Optimizations),
        "\n## Dataset entries (`datasets[]`)\n",
        "Each entry is an object whose `type` picks the storage backend.\n",
        "### `type: \"local\"`\n",
        model_table(LocalDatasetConfig),
        "\n### `type: \"in_memory\"`\n",
        "The same keys as `local`, plus `in_memory`:\n",
        model_table(InMemoryDatasetConfig),
        "\n#### `in_memory`\n",
        model_table(InMemoryOptions),
        "",
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0] if argv else "documentation/CONFIG.md")
    out.write_text(render())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
