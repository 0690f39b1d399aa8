"""The house's floors (docs/architecture.md): no import circles, and no import arrow from a
lower floor up to a higher one. Every ``import`` statement of akv counts, also those inside
functions and under ``TYPE_CHECKING``: a circle hidden from the interpreter still ties two
modules together for a reader."""

from __future__ import annotations

import ast
from pathlib import Path

AKV = Path(__file__).resolve().parent.parent / "akv"

#: Bottom up; a module may import only from its own floor or the floors below it.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ()),  # every module not named below: geometry, plan, sharding, exposure, packing, ...
    ("protocol", ("akv.protocol", "akv.ledger")),
    ("backends", ("akv.backends", "akv.runtime.local")),  # NIXL agents; ranks of this process
    ("paths", ("akv.runtime.paths",)),
    ("runtime", ("akv.runtime",)),
    ("integrations", ("akv.integrations", "akv.testing")),
    ("bench", ("akv.bench",)),
    ("cli", ("akv.cli", "akv.__main__")),
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in AKV.rglob("*.py"):
        parts = list(path.relative_to(AKV.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports() -> dict[str, set[str]]:
    """Module -> the akv modules it imports (``from pkg import mod`` names the module)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[mod].update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in mods:
                        edges[mod].add(sub)
                    elif base in mods:
                        edges[mod].add(base)
        edges[mod].discard(mod)
    return edges


def _floor(mod: str) -> int | None:
    """The floor of ``mod``: that of its longest matching prefix (core if none); None for
    the package itself, whose lazy facade names everything public."""
    if mod == "akv":
        return None
    matches = [
        (len(p), i)
        for i, (_, prefixes) in enumerate(FLOORS)
        for p in prefixes
        if mod == p or mod.startswith(p + ".")
    ]
    return max(matches)[1] if matches else 0


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    """No two akv modules import each other, directly or through others."""
    assert _circles(_imports()) == []


def test_no_import_runs_up_a_floor() -> None:
    """Each import goes to the module's own floor or below (see FLOORS and docs/architecture.md)."""
    upward = []
    for mod, targets in sorted(_imports().items()):
        here = _floor(mod)
        for target in sorted(targets):
            there = _floor(target)
            if here is not None and there is not None and there > here:
                upward.append(f"{mod} ({FLOORS[here][0]}) -> {target} ({FLOORS[there][0]})")
    assert upward == []


def test_the_checks_see_a_circle_and_an_upward_arrow() -> None:
    """The two checks above are not vacuous: a made-up circle and an arrow up are found."""
    edges = {"akv.a": {"akv.b"}, "akv.b": {"akv.c"}, "akv.c": {"akv.a"}, "akv.d": set()}
    assert _circles(edges) == [["akv.a", "akv.b", "akv.c"]]
    assert _floor("akv.runtime.paths.read") < _floor("akv.runtime.session") < _floor("akv.cli.main")  # type: ignore[operator]
    assert _floor("akv.geometry.cache") == 0 and _floor("akv.bench.run") < _floor("akv.cli.main")  # type: ignore[operator]
