"""The package's modules import each other without a circle: each parsed with ``ast``, every
import (absolute or relative, at module level or inside a function) an edge, imports under
``if TYPE_CHECKING:`` excepted; a cycle fails the test, printed.

``python tests/unit/test_import_layers.py`` prints every cycle (one per strongly connected
group of modules)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, Optional

PACKAGE = Path(__file__).resolve().parents[2] / "mlx_parallm_provider"
ROOT = PACKAGE.name


def modules() -> dict[str, Path]:
    """Every module of the package: its dotted name -> its file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.stmt]:
    """Import statements anywhere (functions, classes, try blocks), except under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, known: dict[str, Path]) -> Optional[str]:
    """The package module ``name`` names (a name imported from a module: that module)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules module ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                prefix = package
                for _ in range(node.level - 1):
                    prefix = prefix.rpartition(".")[0]
                base = f"{prefix}.{base}" if base else prefix
            names = [f"{base}.{alias.name}" for alias in node.names]
        for imported in names:
            if imported.split(".")[0] == ROOT:
                target = _resolve(imported, known)
                if target is not None and target != name:
                    targets.add(target)
    return targets


def graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated last) per strongly connected group of
    more than one module."""
    return [_cycle_in(group, edges) for group in groups(edges)]


def groups(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module: modules that import each other,
    directly or not (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def _cycle_in(group: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the group's first module (breadth-first, inside the group)."""
    members, start = set(group), group[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return group


def describe(edges: dict[str, set[str]]) -> str:
    """Each group of modules that import each other, and one cycle through it (``a -> b -> a``),
    the package's name left out."""
    short = lambda m: m.removeprefix(ROOT + ".")  # noqa: E731
    return "\n".join(f"{len(group)} modules ({', '.join(map(short, group))}); a cycle: "
                     + " -> ".join(map(short, _cycle_in(group, edges))) for group in groups(edges))


def test_no_import_cycles() -> None:
    edges = graph()
    assert not groups(edges), "import cycles:\n" + describe(edges)


MODEL_FLOORS = (
    ("native build, cache and extension", ("models.kernel_cache", "models.qmatmul", "models.qmatmul_ext")),
    ("device (is_cpu, the BLAS)", ("models.device",)),
    ("ops", ("models.attention", "models.cpu_ops", "models.fused_ops", "models.small_batch", "models.private_blas", "models.lora",
             "models.paged_kernels", "models.softcap")),
    ("backends", ("models.backends", "models.head")),
    ("loading", ("models.backend", "models.registry", "models.gguf")),
)
"""models/'s floors, lowest first: a module imports nothing of a floor above its own (an entry
covers the modules under it too). The package's ``__init__`` (it preloads the BLAS) is on the
device floor."""


def _floor(module: str) -> Optional[int]:
    short = module.removeprefix(ROOT + ".")
    if short == "models":
        return 1
    best: Optional[tuple[int, int]] = None  # (length of the entry matched, floor)
    for number, (_, names) in enumerate(MODEL_FLOORS):
        for name in names:
            if (short == name or short.startswith(name + ".")) and (best is None or len(name) > best[0]):
                best = (len(name), number)
    return None if best is None else best[1]


def test_models_modules_import_no_floor_above_their_own() -> None:
    edges = graph()
    unplaced = sorted(m for m in edges if m.startswith(f"{ROOT}.models") and _floor(m) is None)
    assert unplaced == [], f"models/ modules on no floor (add them to MODEL_FLOORS): {unplaced}"
    upward = [f"{m} ({MODEL_FLOORS[_floor(m)][0]}) imports {t} ({MODEL_FLOORS[_floor(t)][0]})"
              for m in sorted(edges) if _floor(m) is not None
              for t in sorted(edges[m]) if _floor(t) is not None and _floor(t) > _floor(m)]
    assert upward == [], "imports up a floor:\n" + "\n".join(upward)


def test_the_graph_sees_relative_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    known = {f"{ROOT}.a": tmp_path / "a.py", f"{ROOT}.b": tmp_path / "b.py", f"{ROOT}.c": tmp_path / "c.py",
             f"{ROOT}.d": tmp_path / "d.py"}
    (tmp_path / "a.py").write_text(
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\nfrom . import b\n"
        "if TYPE_CHECKING:\n    from .d import Thing\n"
        "def f():\n    from .c import g\n    import mlx_parallm_provider.d\n")
    assert imports_of(f"{ROOT}.a", tmp_path / "a.py", known) == {f"{ROOT}.b", f"{ROOT}.c", f"{ROOT}.d"}
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z", "x"]]


if __name__ == "__main__":
    edges = graph()
    print(describe(edges) or "no cycles")
    sys.exit(1 if groups(edges) else 0)


POLICY = ("engine.scheduler", "engine.plan", "engine.output", "engine.kv.manager", "engine.kv.block_pool",
          "engine.drafting", "engine.drafting.ngram", "engine.drafting.forced", "engine.drafting.step_times")
"""The engine's policy and bookkeeping: they import no MLX, directly or through the package
modules they import (a parent package's ``__init__`` aside)."""


def _outside_imports(path: Path) -> set[str]:
    """The top-level names of what module ``path`` imports from outside the package."""
    names = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - {ROOT}


def test_the_scheduler_kv_manager_and_drafting_policy_import_no_mlx() -> None:
    edges, known = graph(), modules()
    for start in POLICY:
        seen, todo = set(), [f"{ROOT}.{start}"]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(edges[module])
        heavy = sorted(m for m in seen if _outside_imports(known[m]) & {"mlx", "mlx_lm"})
        assert heavy == [], f"{start} imports MLX through {heavy}"
