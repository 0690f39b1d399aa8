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


#: The most lines a runtime module may have (docs/architecture.md: one job a file).
RUNTIME_LINES = 600
#: The concrete path ops: only their own floor and the factory that builds them
#: (`akv.runtime.routes`) may name them; the poller, the session and the transfer drive any op
#: through `akv.runtime.paths.PathOp`.
OP_CLASSES = {"NixlRead", "SettledRead", "PackedRead", "PushOp", "PackedPush", "LocalCopy"}


def test_no_runtime_module_runs_over_the_size_cap() -> None:
    """Every module under akv/runtime/ (paths included) keeps to RUNTIME_LINES lines."""
    long = {
        str(path.relative_to(AKV.parent)): n
        for path in (AKV / "runtime").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > RUNTIME_LINES
    }
    assert long == {}


def _op_uses(mod: str, path: Path) -> list[str]:
    """Where ``mod`` names a concrete path op class, asks ``isinstance`` of one, or reaches an
    op's attribute by ``getattr``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("akv.runtime.paths"):
            found += [f"{mod} imports {a.name}" for a in node.names if a.name in OP_CLASSES]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            if node.func.id == "isinstance" and len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                found += [f"{mod} asks isinstance(..., {n})" for n in sorted(names & OP_CLASSES)]
            first = node.args[0]
            named_op = (isinstance(first, ast.Attribute) and first.attr == "op") or (
                isinstance(first, ast.Name) and first.id == "op"
            )
            if node.func.id == "getattr" and named_op:
                found.append(f"{mod} reaches an op by getattr")
    return found


def test_only_the_paths_and_their_factory_know_the_path_ops() -> None:
    """Outside akv.runtime.paths, only akv.runtime.routes names a concrete path op class; no
    module outside the paths floor asks isinstance of one or reaches an op by getattr: the
    poller, session and transfer drive every path through the PathOp protocol."""
    found = []
    for mod, path in sorted(_modules().items()):
        if _floor(mod) == 3:  # the paths floor itself
            continue
        uses = _op_uses(mod, path)
        if mod == "akv.runtime.routes":  # it builds them: it may import them, no more
            uses = [u for u in uses if " imports " not in u]
        found += uses
    assert found == []


def test_the_op_check_sees_what_it_forbids(tmp_path: Path) -> None:
    """The check above is not vacuous: an import of an op class, an isinstance of one and a
    getattr on an op are each found."""
    src = tmp_path / "m.py"
    src.write_text(
        "from akv.runtime.paths.push import PushOp\n"
        "def f(t):\n    return isinstance(t.op, (PushOp, int)) or getattr(t.op, 'finished', None)\n"
    )
    assert _op_uses("m", src) == [
        "m imports PushOp",
        "m asks isinstance(..., PushOp)",
        "m reaches an op by getattr",
    ]
