"""Generate documentation/CONFIG.md from the schema: ``python -m simpletuner.configuration.docs``.

A test regenerates it and compares, so the reference never drifts from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from simpletuner.configuration.foreign_keys import FOREIGN_KEYS, FOREIGN_VALUES
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

**Relative paths are taken from the config file's folder**, not from the folder you run in:
`output_dir`, `cache_config.cache_dir`, `resume_from_checkpoint`, `data_backend_config` and each
dataset's `instance_data_dir` (also those of a `data_backend_config` file), given relative, and
the defaults `output` and `cache`, resolve against the folder holding the config, so the same
config run from another folder writes to and reads from the same places. `--set` values follow
the same rule. (Before this release, all but `data_backend_config` were taken from the working
directory: a config that relied on that now points elsewhere; give absolute paths to be sure.)
`pretrained_model_name_or_path` is still taken as written (a local folder, or a hub id).

`model_family` may be left out: it is then read from the model folder's `model_index.json`.

This file is generated from `simpletuner/configuration/schema.py` and
`simpletuner/configuration/foreign_keys.py` by `python -m simpletuner.configuration.docs`;
a test fails when they differ.
"""

ERRORS = """## How problems are reported

The config is checked as a whole before anything loads, and one run reports every problem it
finds, one line each with the key's path and the fix: unknown keys, wrong types and values,
rules between keys (`validation_steps` without `validation_prompt`, a `resolution` that is not
a multiple of `aspect_bucket_alignment`, ...) and paths that do not exist. A rule whose own
input is wrong is checked once that input is fixed, so no line is a consequence of another.

```
4 problem(s) in cfg.json:
  - train_batch_size: expected a whole number, got 'four'
  - learning_rat: unknown key 'learning_rat'; did you mean 'learning_rate'? (remove it or fix the spelling)
  - validation_resolution: `validation_resolution` is a SimpleTuner key that this trainer does not support yet: validation images use `resolution`; remove it
  - (top level): `validation_steps` is set but `validation_prompt` is not (nor `validation_prompts`): add a prompt or remove validation_steps
```

- **Did you mean**: offered only when the unknown key reads as a typo of one of ours (a letter
  missing, added, swapped or changed, or underscores moved: `train_batchsize`); a key that only
  looks alike (`loss_type` beside `lora_type`) gets no guess.
- **Keys of other tools**: keys of SimpleTuner, kohya sd-scripts and ai-toolkit configs that
  are not ours are named as such, with the key that does the same job here or a note on what
  happens instead (table below); a few of their values of keys we share are recognised too
  (`base_model_precision: "int8-quanto"` is our `qint8`). SimpleTuner's `--key` spelling is
  pointed out. Nothing is translated: the message says what to write.
- **`cuda_allocator`**: one line per key PyTorch would refuse, whatever the value's type:
  `use_uvm` and other keys of patched builds with what to use instead, other unknown keys with
  the list PyTorch accepts, known keys with the values they take.
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


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def foreign_tables() -> str:
    """The keys and values of other tools' configs that errors recognise (foreign_keys.py)."""
    rows = [
        "## Keys from other tools\n",
        "What an error says for a key of another trainer's config. `same`: our key means the same, use it "
        "instead; `approximated`: the nearest setting here, the note says what differs; `unsupported`: nothing "
        "here does it yet; `ignored`: irrelevant here.\n",
        "| key | tool | where | here | kind | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for e in FOREIGN_KEYS:
        where = "top level" if e.section == "top" else "dataset entry"
        ours = f"`{e.ours}`" if e.ours else "—"
        rows.append(f"| `{e.key}` | {e.tool} | {where} | {ours} | {e.kind} | {_cell(e.note)} |")
    rows += [
        "",
        "Values of keys we share, spelled differently there:\n",
        "| key | value | tool | here | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for v in FOREIGN_VALUES:
        ours = f"`{v.ours}`" if v.ours else "—"
        rows.append(f"| `{v.key}` | `{v.value}` | {v.tool} | {ours} | {_cell(v.note)} |")
    return "\n".join(rows)


def render() -> str:
    parts = [
        HEADER,
        ERRORS,
        "## Top-level keys\n",
        model_table(TrainingConfig),
        "\n## `cache_config`\n",
        model_table(CacheConfig),
        "\n## `gh200_optimizations`\n",
        model_table(GH200Optimizations),
        "\n## Dataset entries (`datasets[]`)\n",
        "Each entry is an object whose `type` picks the storage backend.\n",
        '### `type: "local"`\n',
        model_table(LocalDatasetConfig),
        '\n### `type: "in_memory"`\n',
        "The same keys as `local`, plus `in_memory`:\n",
        model_table(InMemoryDatasetConfig),
        "\n#### `in_memory`\n",
        model_table(InMemoryOptions),
        "",
        foreign_tables(),
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
