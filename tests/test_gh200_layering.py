"""The GH200 layer sits beside data_backend and caching, below training: it never imports
simpletuner.training (nor the entry points above it), at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GH200 = Path(__file__).resolve().parent.parent / "simpletuner" / "gh200"
ABOVE = ("simpletuner.training", "simpletuner.train", "simpletuner.cli", "simpletuner.demo")


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level >= 2:  # from ..training import x
            found += [(node.lineno, f"simpletuner.{node.module or ''}")]
    return found


@pytest.mark.parametrize("path", sorted(GH200.glob("*.py")), ids=lambda p: p.name)
def test_gh200_never_imports_the_layers_above_it(path):
    bad = [
        f"{path.name}:{line} imports {name}"
        for line, name in _imports(path)
        if any(name == top or name.startswith(top + ".") for top in ABOVE)
    ]
    assert not bad, "simpletuner/gh200 must not import training or the entry points: " + "; ".join(bad)
