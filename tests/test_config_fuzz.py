"""Property: no config input crashes the program.

Every example config shipped in ``config/examples`` is mutated by Hypothesis (a key dropped or
added, a value retyped, made extreme, non-finite, very long, unicode, empty, or a path that names
a file where a folder belongs and the reverse) and then run through

* the real validation of ``simpletuner train`` (:func:`simpletuner.train.prepare_config`: the
  launcher merge, the schema, the cross-field rules and the path checks), which must return a
  config or raise :class:`ConfigError` (``train`` exits 2 with its message), and
* ``simpletuner estimate`` in-process through its ``main``, which must exit 0, 1 or 2 without a
  traceback: never 70 (an internal error).

The examples name model folders of real checkpoints; as in ``test_estimate_examples.py`` each one
runs against a config-only tiny folder of its family, and its dataset folders point at one empty
folder, so that an unmutated example is valid and every failure comes from the mutation.
Hypothesis is derandomised (the same examples on every run) and capped to keep the file's wall
time within its budget; the estimate (about a second a call) gets fewer examples than validation.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simpletuner.cli import main as cli_main
from simpletuner.cli.train import prepare_config
from simpletuner.configuration import ConfigError
from simpletuner.configuration.schema import CacheConfig, GH200Optimizations, InMemoryDatasetConfig, TrainingConfig
from simpletuner.resources import examples_dir

EXAMPLES = sorted(examples_dir().glob("*.json"))
#: SD 3.5 Medium's position-embedding size (patches per side); the tiny SD3 has 16, too few for 1024 px.
SD35_POS_EMBED_MAX_SIZE = 384
_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- the world the examples run in ----------------------------------------------------------------
class World:
    """Config-only tiny models, an empty data folder, a plain file and a fresh folder per example."""

    def __init__(self, root: Path):
        from simpletuner.testing.zoo import write_tiny_model

        self.root = root
        self.models: dict[str, Path] = {}
        for kind in ("sd", "sdxl", "sd3", "flux", "wan", "wan22"):
            folder = write_tiny_model(kind, root / "models" / kind)
            for weights in folder.rglob("*.safetensors"):
                weights.unlink()  # neither validation nor the estimate reads weights
            if kind == "sd3":
                path = folder / "transformer" / "config.json"
                path.write_text(
                    json.dumps({**json.loads(path.read_text()), "pos_embed_max_size": SD35_POS_EMBED_MAX_SIZE})
                )
            self.models[kind] = folder
        self.data = root / "data"
        self.data.mkdir()
        self.plain_file = root / "a_file.txt"
        self.plain_file.write_text("a plain file, not a folder\n")
        self._count = itertools.count()

    def model_for(self, raw: dict) -> Path:
        family = raw["model_family"]
        return self.models["wan22" if family == "wan" and "Wan2.2" in raw["pretrained_model_name_or_path"] else family]

    def fresh_folder(self) -> Path:
        folder = self.root / "runs" / f"case{next(self._count)}"
        folder.mkdir(parents=True)
        return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("fuzz"))


def _runnable(example: Path, world: World) -> tuple[dict, list | None]:
    """The example made valid here: the tiny model of its family, datasets in the empty folder. A
    ``data_backend_config`` file's entries come back separately (written next to the config)."""
    raw = json.loads(example.read_text())
    raw["pretrained_model_name_or_path"] = str(world.model_for(raw))
    entries = None
    if "data_backend_config" in raw:
        entries = json.loads((example.parent / raw["data_backend_config"]).read_text())
        raw["data_backend_config"] = "datasets.json"
    for entry in raw.get("datasets") or entries or []:
        entry["instance_data_dir"] = str(world.data)
    return raw, entries


# --- mutations --------------------------------------------------------------------------------------
_FIELDS_BY_SECTION = {
    (): list(TrainingConfig.model_fields),
    ("cache_config",): list(CacheConfig.model_fields),
    ("gh200_optimizations",): list(GH200Optimizations.model_fields),
    ("datasets", 0): list(InMemoryDatasetConfig.model_fields),
}
_OTHER_TYPES = [[], {}, "text", 7, 0.5, True, None, [1, "a"], {"k": 1}]
_EXTREMES = [
    0,
    -1,
    1,
    3,
    1025,
    16384,
    10**6,
    2**31,
    2**63,
    10**30,
    -(10**30),
    1e308,
    -1e308,
    5e-324,
    1e-30,
    1e12,
    0.5,
    -0.5,
]
_NON_FINITE = ["nan", "inf", "-inf", "1e400", "-1e400", "NaN", "Infinity"]
_LONG = ["x" * 256, "y" * 300, "é" * 200, "/tmp/" + "z" * 300, "a/" * 2100, "q" * 5000]
_TRICKY = ["\x00", "a\x00b", "日本語", "\u202e", "🙂", "e\u0301", "..", ".", "/", "~", "a/../../b", " "]


def _paths(raw: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of ``raw`` (dicts and list items), outermost first."""
    out: list[tuple] = []
    items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(raw, list) else ()
    for key, value in items:
        out.append(prefix + (key,))
        out.extend(_paths(value, prefix + (key,)))
    return out


def _value_for(op: str, world: World, draw) -> Any:
    if op == "retype":  # a copy: a later mutation may write into it, and the next example must not see that
        return copy.deepcopy(draw(st.sampled_from(_OTHER_TYPES)))
    if op == "extreme":
        return draw(st.sampled_from(_EXTREMES))
    if op == "non_finite":
        return draw(st.sampled_from(_NON_FINITE))
    if op == "long":
        return draw(st.sampled_from(_LONG))
    if op == "unicode":
        return draw(st.one_of(st.sampled_from(_TRICKY), st.text(min_size=0, max_size=12)))
    if op == "file":
        return str(world.plain_file)
    if op == "folder":
        return str(world.data)
    return ""  # empty


_OPS = ["drop", "retype", "extreme", "non_finite", "long", "unicode", "file", "folder", "empty"]


def _set(raw: Any, path: tuple, value: Any, drop: bool) -> None:
    node = raw
    for key in path[:-1]:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return  # an earlier mutation replaced the parent: nothing to change
    last = path[-1]
    if isinstance(node, dict):
        if drop:
            node.pop(last, None)
        else:
            node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        if drop:
            del node[last]
        else:
            node[last] = value


@st.composite
def mutated_examples(draw, world: World, most: int = 3):
    """(example name, mutated raw config, data_backend_config entries, the mutations made): 1 to
    ``most`` mutations."""
    example = draw(st.sampled_from(EXAMPLES))
    raw, entries = _runnable(example, world)
    target = {"raw": raw, "entries": entries}
    done = []
    for _ in range(draw(st.integers(1, most))):
        existing = [("raw",) + p for p in _paths(raw)] + (
            [("entries",) + p for p in _paths(entries)] if entries else []
        )
        added = [("raw",) + section + (name,) for section, names in _FIELDS_BY_SECTION.items() for name in names]
        path = draw(st.sampled_from(existing + added))
        op = draw(st.sampled_from(_OPS))
        value = None if op == "drop" else _value_for(op, world, draw)
        _set(target, path, value, drop=op == "drop")
        shown = repr(value)
        done.append((path, op, shown if len(shown) < 60 else f"{shown[:40]}... ({len(shown)} chars)"))
    return example.name, target["raw"], target["entries"], done


def _write(world: World, raw: Any, entries: Any) -> Path:
    folder = world.fresh_folder()
    if entries is not None:
        (folder / "datasets.json").write_text(json.dumps(entries, allow_nan=False))
    path = folder / "config.json"
    path.write_text(json.dumps(raw, allow_nan=False))
    return path


# --- the properties ---------------------------------------------------------------------------------
def test_every_example_is_valid_here_unmutated(world):
    """The baseline: each example, pointed at the tiny model and the empty data folder, validates,
    so a mutated example that fails, fails because of its mutation."""
    assert len(EXAMPLES) >= 10
    for example in EXAMPLES:
        raw, entries = _runnable(example, world)
        prepare_config(str(_write(world, raw, entries)), environ={}, launch_command=None)


def _validation_outcome(path: Path) -> int:
    """``train``'s validation of the config at ``path``: 0 accepted, 2 refused with a ConfigError.
    Anything else raised is a crash (Hypothesis reports it with the example)."""
    try:
        prepare_config(str(path), environ={}, launch_command=None)
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p, str) and p.strip() for p in exc.problems), exc.problems
        return 2
    return 0


def test_mutated_examples_validate_or_are_refused_clearly(world):
    outcomes: dict[int, int] = {}

    @settings(max_examples=1000, **_SETTINGS)
    @given(case=mutated_examples(world))
    def check(case):
        _, raw, entries, _ = case
        code = _validation_outcome(_write(world, raw, entries))
        outcomes[code] = outcomes.get(code, 0) + 1

    check()
    assert outcomes.get(0) and outcomes.get(2), outcomes  # both kinds of outcome were explored


def _estimate(path: Path, extra: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["estimate", "--config", str(path), "--json", *extra])
    return code, err.getvalue()


def test_mutated_examples_estimate_or_are_refused_clearly(world):
    outcomes: dict[int, int] = {}

    @settings(max_examples=40, **_SETTINGS)
    @given(case=mutated_examples(world, most=1), extra=st.sampled_from([[], ["--gpu-memory", "1"], ["--gpu", "h100"]]))
    def check(case, extra):
        _, raw, entries, _ = case
        code, err = _estimate(_write(world, raw, entries), extra)
        assert code in (0, 1, 2) and "Traceback" not in err, f"exit {code}:\n{err}"
        outcomes[code] = outcomes.get(code, 0) + 1

    check()
    assert outcomes.get(0) and outcomes.get(2), outcomes  # real estimates ran, and refusals
