"""Which part of simpletuner may import which: the layering rule, written down once.

``tests/test_layering.py`` reads every module's imports (module level and inside functions) and
fails on an arrow this table does not allow, naming the file, the line and the two parts; it also
fails on an import cycle between modules at module level. Imports under ``if TYPE_CHECKING:`` are
annotations only and are not arrows.

A module's *part* is the longest entry of :data:`LAYERS` that is its dotted name below
``simpletuner`` or a package above it (``models.adapters.lycoris`` is in ``models``;
``memory.cli`` is a part of its own). An import is allowed when

* both modules are in the same part, or
* the imported part sits in a lower layer, or
* both parts share a layer and :data:`BESIDE` lists the arrow (a set there names the only
  functions or classes that may be imported across it: a narrow door, not a free passage).

Nothing may import a part in a higher layer.
"""

from __future__ import annotations

#: Any name may cross a :data:`BESIDE` arrow.
ANY = None

#: Lowest first.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Leaf helpers: each imports nothing from simpletuner but (diskspace) an exit code and (locks) diskspace.
    (
        "__init__",
        "commands",
        "diskspace",
        "exit_codes",
        "faults",
        "file_modes",
        "host",
        "layers",
        "locks",
        "precision",
        "resources",
    ),
    ("configuration",),
    ("state",),
    # gh200 sits beside data_backend (its in-memory backend is a data backend) and below caching:
    # the memory stores place and prefetch through gh200.uvm; gh200 never imports caching.
    ("data_backend", "gh200"),
    ("caching",),
    ("models",),  # with models.adapters: LoRA, LyCORIS, quantisation, the trainable set-up
    # memory sits beside training: it never imports training; training asks it through BESIDE's door.
    ("memory", "training"),
    # Commands: each is a `simpletuner` sub-command (memory.profile runs the Trainer for `estimate --profile`).
    ("train", "demo", "convert", "caching.admin", "memory.cli", "memory.estimate_command", "memory.profile"),
    ("cli",),
)

#: Arrows between parts of one layer, one way each: ``(importer, imported) -> ANY or allowed names``.
BESIDE: dict[tuple[str, str], frozenset[str] | None] = {
    ("diskspace", "exit_codes"): ANY,
    # A full disk while a lock file or a cache-user record is written: checked first, one message.
    ("locks", "diskspace"): frozenset(
        {
            "diskspace.NoSpace",
            "diskspace.disk_full_guard",
            "diskspace.free_bytes",
            "diskspace.inject_fault",
            "diskspace.is_disk_full",
            "diskspace.require_space",
        }
    ),
    ("gh200", "data_backend"): ANY,
    # The `in_memory` entry of data_backend.factory.BUILDERS, imported when a dataset asks for it.
    ("data_backend", "gh200"): frozenset({"gh200.in_memory_backend.build_in_memory_backend"}),
    ("training", "memory"): frozenset(
        {
            "memory.hardware.detect_hardware",  # the GPU behind MFU
            "memory.oom.explain_out_of_memory",  # what to say after an OOM
            "memory.preflight.check_run_memory",  # does the run fit before the cache fill
        }
    ),
    ("memory.cli", "memory.estimate_command"): ANY,  # the options, then the work (imported on use)
    ("memory.estimate_command", "memory.profile"): ANY,
    ("demo", "train"): frozenset({"train.main"}),  # the demo ends by training on what it wrote
}


def part_of(module: str, parts: tuple[str, ...] | None = None) -> str | None:
    """The part of ``module`` (dotted, below ``simpletuner``; ``__init__`` for the package itself)."""
    parts = parts if parts is not None else tuple(p for layer in LAYERS for p in layer)
    best = None
    for part in parts:
        if (module == part or module.startswith(part + ".")) and (best is None or len(part) > len(best)):
            best = part
    return best


def layer_of(part: str) -> int:
    """The index in :data:`LAYERS` of ``part`` (0: lowest)."""
    for index, layer in enumerate(LAYERS):
        if part in layer:
            return index
    raise KeyError(part)


def arrow_problem(importer: str, imported: str, name: str) -> str | None:
    """Why ``importer`` (a module) may not import ``name`` from ``imported`` (a module), or None.

    ``name``: the dotted thing imported (``memory.oom.explain_out_of_memory``), or the module itself.
    """
    source, target = part_of(importer), part_of(imported)
    if source is None or target is None:
        missing = importer if source is None else imported
        return f"{missing} is in no layer of simpletuner/layers.py"
    if source == target:
        return None
    source_layer, target_layer = layer_of(source), layer_of(target)
    if source_layer > target_layer:
        return None
    if source_layer == target_layer and (source, target) in BESIDE:
        allowed = BESIDE[(source, target)]
        if allowed is ANY or name in allowed:
            return None
        return f"{source} may import only {', '.join(sorted(allowed))} from {target}"
    where = "beside" if source_layer == target_layer else "above"
    return f"layer {source} may not import layer {target} ({target} is {where} it)"
