"""Generate documentation/CONFIG.md, MIGRATING_FROM_SIMPLETUNER.md and MIGRATING_FROM_AI_TOOLKIT.md:
``python -m simpletuner.configuration.docs``.

Each document is a template of the same name in ``templates/`` (the prose) whose ``{{name}}`` lines are
replaced by tables made from the config models, the family table and the SimpleTuner dialect table
(:data:`TABLES`). A test regenerates both and compares, so the references never drift from the code.
"""

from __future__ import annotations

import json
import re
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from simpletuner.configuration.dataset_sections import (
    AspectBucket,
    CaptionShuffle,
    HuggingFaceDatasetConfig,
    MetadataFileOptions,
    ObjectStoreDatasetConfig,
    ParquetDatasetConfig,
    WebDatasetConfig,
)
from simpletuner.configuration.families import FAMILIES
from simpletuner.configuration.foreign_keys import FOREIGN_KEYS, FOREIGN_VALUES
from simpletuner.configuration.optimizer_settings import NAMED_OPTIMIZER_DEFAULTS, OPTIMIZER_SETTINGS
from simpletuner.configuration.schema import (
    CacheConfig,
    GH200Optimizations,
    InMemoryDatasetConfig,
    InMemoryOptions,
    LocalDatasetConfig,
    TrainingConfig,
)
from simpletuner.configuration.sections import (
    Augmentations,
    LycorisModuleOptions,
    LycorisOptions,
    LycorisPreset,
    TreadConfig,
    TreadRoute,
)
from simpletuner.configuration.simpletuner import facts
from simpletuner.configuration.simpletuner.translate import DIALECT

TEMPLATES = Path(__file__).with_name("templates")


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


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    if field.default_factory is not None:
        return "(object)"
    return "`null`" if field.default is None else f"`{field.default!r}`".replace("'", '"')


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _here(ours: Optional[str]) -> str:
    return f"`{ours}`" if ours else "—"


def _table(header: Iterable[str], rows: Iterable[str]) -> str:
    header = list(header)
    return "\n".join([f"| {' | '.join(header)} |", "| " + " | ".join("---" for _ in header) + " |", *rows])


def model_table(model: type[BaseModel]) -> str:
    """A config model's keys: type, default and description."""
    rows = (
        f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {_cell(field.description or '')} |"
        for name, field in model.model_fields.items()
    )
    return _table(("key", "type", "default", "meaning"), rows)


def family_table() -> str:
    """The family table (families.py)."""

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    rows = (
        f"| `{f.name}` | {f.summary} | {', '.join(f'`{c}`' for c in f.pipeline_classes)} | "
        f"{yes(f.flow_matching)} | {yes(f.video)} | {yes(f.experts)} | {yes(f.negative_prompt)} | "
        f"{f.latent_grid[0] * f.latent_grid[1]} | {', '.join(f'`{n}`' for n in f.simpletuner_names)} |"
        for f in FAMILIES.values()
    )
    header = ("family", "model", "`_class_name`", "flow matching", "video", "experts", "negative prompt")
    return _table((*header, "latent grid (px)", "SimpleTuner `model_family`"), rows)


def foreign_key_table() -> str:
    """The keys of other tools' configs that errors recognise (foreign_keys.py)."""
    rows = (
        f"| `{e.key}` | {e.tool} | {'top level' if e.section == 'top' else 'dataset entry'} | {_here(e.ours)} | "
        f"{e.kind} | {_cell(e.note)} |"
        for e in FOREIGN_KEYS
    )
    return _table(("key", "tool", "where", "here", "kind", "note"), rows)


def foreign_value_table() -> str:
    """Other tools' spellings of values of keys we share (foreign_keys.py)."""
    rows = (f"| `{v.key}` | `{v.value}` | {v.tool} | {_here(v.ours)} | {_cell(v.note)} |" for v in FOREIGN_VALUES)
    return _table(("key", "value", "tool", "here", "note"), rows)


def optimizer_settings_table() -> str:
    """Each optimizer's `optimizer_config` keys (optimizer_settings.py)."""
    rows = (
        f"| `{name}` | `{key}` | {_cell(meaning)} |"
        for name, settings in OPTIMIZER_SETTINGS.items()
        for key, (_, meaning) in settings.items()
    )
    return _table(("optimizer", "`optimizer_config` key", "meaning"), rows)


def optimizer_default_table() -> str:
    """The defaults of the optimizers named as SimpleTuner names them (optimizer_settings.py)."""
    rows = (
        f"| `{name}` | `{key}` | `{json.dumps(value)}` | `{where}` |"
        for name, defaults in NAMED_OPTIMIZER_DEFAULTS.items()
        for key, (value, where) in defaults.items()
    )
    return _table(("optimizer", "key", "default", "SimpleTuner's line"), rows)


def simpletuner_default_table() -> str:
    """SimpleTuner's defaults written into a translation (facts.py)."""
    rows = [f"| `{key}` | `{value!r}` |".replace("'", '"') for key, value in facts.SIMPLETUNER_DEFAULTS.items()]
    rows += [
        f"| dataset `{key}` | `{value!r}` |".replace("'", '"')
        for key, value in facts.SIMPLETUNER_DATASET_DEFAULTS.items()
    ]
    return _table(("key", "SimpleTuner default"), rows)


def simpletuner_family_table() -> str:
    """SimpleTuner's families, what each is here, and its flavours (facts.py)."""
    rows = []
    for family, ours in facts.SIMPLETUNER_FAMILIES.items():
        flavours = ", ".join(f"`{f}` ({hub})" for f, hub in facts.FLAVOURS.get(family, {}).items())
        rows.append(f"| `{family}` | {_here(ours)} | {flavours or '—'} |")
    return _table(("SimpleTuner family", "here", "flavours (hub model)"), rows)


def unsupported_flavours() -> str:
    """The flavours that stop a run, one sentence."""
    reasons = "; ".join(f"`{marker}...`: {why}" for marker, why in facts.FLAVOUR_UNSUPPORTED.items())
    return f"Flavours that stop the run: {reasons}."


def value_spelling_table() -> str:
    """Every value spelling the translation reads (facts.VALUE_TABLES)."""
    rows = (
        f"| `{key}` | `{value}` | {_here(ours) if ours is not None else 'unsupported'} |"
        for key, table in facts.VALUE_TABLES.items()
        for value, ours in table.items()
    )
    return _table(("key", "SimpleTuner value", "here"), rows)


def ait_table(*sections: str) -> str:
    """Every key of an ai-toolkit trainer job in ``sections``, the named rows first, then the tail, each sorted."""
    from simpletuner.configuration.aitoolkit.table import AIT_DIALECT

    rows = (
        f"| `{e.key}` | {e.kind} | {_here(e.ours)} | {_cell(e.note)} |"
        for e in sorted(
            (e for e in AIT_DIALECT if e.section in sections), key=lambda e: (e.note.startswith("not "), e.key)
        )
    )
    return _table(("key", "kind", "here", "note"), rows)


def dialect_table(section: str) -> str:
    """Every key of SimpleTuner's dialect in ``section`` (``top`` / ``dataset``), sorted."""
    rows = (
        f"| `{e.key}` | {e.kind} | {_here(e.ours)} | {_cell(e.note)} |"
        for e in sorted((e for e in DIALECT if e.section == section), key=lambda e: e.key)
    )
    return _table(("key", "kind", "here", "note"), rows)


_MODELS: tuple[type[BaseModel], ...] = (
    TrainingConfig,
    CacheConfig,
    GH200Optimizations,
    Augmentations,
    LycorisOptions,
    LycorisPreset,
    LycorisModuleOptions,
    TreadConfig,
    TreadRoute,
    LocalDatasetConfig,
    InMemoryDatasetConfig,
    InMemoryOptions,
    ObjectStoreDatasetConfig,
    WebDatasetConfig,
    ParquetDatasetConfig,
    HuggingFaceDatasetConfig,
    MetadataFileOptions,
    CaptionShuffle,
    AspectBucket,
)

#: What a template's ``{{name}}`` line becomes: a config model's table by the model's name, or another table.
TABLES: dict[str, Callable[[], str]] = {
    **{model.__name__: partial(model_table, model) for model in _MODELS},
    "families": family_table,
    "optimizer_settings": optimizer_settings_table,
    "optimizer_defaults": optimizer_default_table,
    "foreign_keys": foreign_key_table,
    "foreign_values": foreign_value_table,
    "simpletuner_defaults": simpletuner_default_table,
    "simpletuner_families": simpletuner_family_table,
    "unsupported_flavours": unsupported_flavours,
    "value_spellings": value_spelling_table,
    "dialect_top": lambda: dialect_table("top"),
    "dialect_dataset": lambda: dialect_table("dataset"),
    "ait_job": lambda: ait_table("job", "process"),
    **{f"ait_{section}": partial(ait_table, section) for section in ("network", "save", "dataset", "train", "model")},
    "ait_sample": lambda: ait_table("sample"),
}

_PLACEHOLDER = re.compile(r"^\{\{(\w+)\}\}$", re.MULTILINE)


def template(name: str) -> str:
    """The template of the document ``name`` (``CONFIG.md``, ...), as written."""
    return (TEMPLATES / name).read_text(encoding="utf-8")


def fill(text: str) -> str:
    """``text`` with each ``{{name}}`` line replaced by :data:`TABLES`' ``name`` table."""
    return _PLACEHOLDER.sub(lambda match: TABLES[match.group(1)](), text)


def render() -> str:
    """documentation/CONFIG.md."""
    return fill(template("CONFIG.md"))


def render_migrating() -> str:
    """documentation/MIGRATING_FROM_SIMPLETUNER.md."""
    return fill(template("MIGRATING_FROM_SIMPLETUNER.md"))


def render_migrating_ai_toolkit() -> str:
    """documentation/MIGRATING_FROM_AI_TOOLKIT.md."""
    return fill(template("MIGRATING_FROM_AI_TOOLKIT.md"))


#: Each generated document and its renderer.
DOCUMENTS = {
    "CONFIG.md": render,
    "MIGRATING_FROM_SIMPLETUNER.md": render_migrating,
    "MIGRATING_FROM_AI_TOOLKIT.md": render_migrating_ai_toolkit,
}


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m simpletuner.configuration.docs [FOLDER]``: write the generated documents into FOLDER."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m simpletuner.configuration.docs",
        description=f"Write {' and '.join(DOCUMENTS)} from the config schema and the SimpleTuner dialect table.",
    )
    parser.add_argument("folder", nargs="?", default="documentation", help="where to write them (default: %(default)s)")
    folder = Path(parser.parse_args(argv).folder)
    if not folder.is_dir():
        parser.error(f"{folder} is not a folder")
    for name, renderer in DOCUMENTS.items():
        out = folder / name
        out.write_text(renderer())
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
