"""Which part of simpletuner may import which: the layering rule, written down once.

Documentation that ``tests/test_layering.py`` enforces: it fails on an import (module level or in a
function; ``if TYPE_CHECKING:`` excepted) this table does not allow, and on a module-level cycle. A module's
*part* is the longest entry of :data:`LAYERS` that is its dotted name below ``simpletuner`` or a package
above it. An import is allowed within a part, into a lower layer, or across one layer where :data:`BESIDE`
lists the arrow (a set there names the only functions or classes allowed). Nothing imports a higher layer.
See documentation/ARCHITECTURE.md, "Layers".
"""

from __future__ import annotations

#: Any name may cross a :data:`BESIDE` arrow.
ANY = None

#: Lowest first.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Leaf helpers: each imports nothing from simpletuner but (diskspace) an exit code and (locks) diskspace.
    (
        "__init__",
        "diskspace",
        "exit_codes",
        "faults",
        "file_modes",
        "layers",
        "locks",
        "precision",
        "ranks",
        "resources",
        "startup",
    ),
    ("configuration",),
    # What machine this is (host and device facts) and the CUDA runtime that reaches the device; and models
    # named by a Hub id, resolved to a folder of the local Hub cache.
    ("hardware", "hub"),
    ("state",),
    # Below caching: the memory stores place and prefetch through gh200.uvm; gh200 never imports caching.
    ("data_backend", "gh200"),
    ("caching",),
    ("models",),  # with models.adapters: LoRA, LyCORIS, quantisation, the trainable set-up
    # memory sits beside training: it never imports training; training asks it through BESIDE's door.
    ("memory", "training"),
    # Scaffolding for tests, benchmarks and the demo (tiny pipelines, config-only folders): never imported below.
    ("testing",),
    # The web UI's model of run folders, its launch queue (subprocesses of `accelerate launch`) and its server:
    # above what it reads (training's run-folder files, locks, configuration, memory) and the demo's writers in
    # testing; below cli, whose `simpletuner ui` starts it.
    ("ui",),
    # The `simpletuner` command and its sub-commands, one module each.
    ("cli",),
    # The entry file of `accelerate launch simpletuner/train.py`: it only calls cli.train.
    ("train",),
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
    ("training", "memory"): frozenset(
        {
            "memory.oom.explain_out_of_memory",  # what to say after an OOM
            "memory.preflight.check_run_memory",  # does the run fit before the cache fill
        }
    ),
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
