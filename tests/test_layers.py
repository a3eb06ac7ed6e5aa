"""Imports point down the layers and never go round in a circle.

    bench                                   (top: imports anything, imported by nothing)
    deploy                                  the launcher: CLI, pool controller, placement, planner
    router | prefill_worker | decode_worker the three process roles; they never import each other
    kvtransfer                              the KV page transport
    cluster                                 what every process shares: secret, auth, service, registry
    proto                                   the wire contracts
    model                                   the decoder, loader, cache layout, sampler, tokenizer
    kernels                                 (bottom)

Every import is read with ``ast``, including those inside functions (a lazy import is still a
dependency), and each failure names the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS: list[tuple[str, ...]] = [
    ("kernels",), ("model",), ("proto",), ("cluster",), ("kvtransfer",),
    ("router", "prefill_worker", "decode_worker"), ("deploy",), ("bench",),
]
RANK = {folder: rank for rank, folders in enumerate(LAYERS) for folder in folders}


def module_name(path: Path) -> str:
    """``router/server.py`` -> ``pdserve.router.server``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pdserve", *parts])


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import statement in ``source``, relative ones resolved."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]  # maybe submodules
    return found


def source_files() -> list[Path]:
    return sorted(p for folder in RANK for p in (ROOT / folder).rglob("*.py"))


def layer_violations(path: Path, source: str) -> list[str]:
    """What is wrong with the imports of ``source`` (the text of ``path``), one line each."""
    module = module_name(path)
    own = module.split(".")[1]
    problems: dict[tuple[int, str], str] = {}  # one line per import statement and folder it reaches
    for target, line in imports_of(source, module, path.name == "__init__.py"):
        top = target.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line}"
        if top in RANK:
            problems.setdefault((line, top), f"{where}: imports {target!r} by its folder name; "
                                              f"import it as 'pdserve.{target}'")
            continue
        if top != "pdserve" or len(target.split(".")) < 2 or target.split(".")[1] not in RANK:
            continue
        folder = target.split(".")[1]
        if RANK[folder] > RANK[own]:
            problems.setdefault((line, folder), f"{where}: {own}/ imports {target!r}, which is above it "
                                                f"(layers: {LAYERS})")
        elif RANK[folder] == RANK[own] and folder != own:
            problems.setdefault((line, folder), f"{where}: {own}/ imports {target!r}: the roles never "
                                                "import each other")
    return list(problems.values())


def import_graph() -> dict[str, dict[str, tuple[Path, int]]]:
    """module -> {imported pdserve module that exists: (file, line)}."""
    files = {module_name(p): p for p in source_files()}
    graph: dict[str, dict[str, tuple[Path, int]]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        for target, line in imports_of(path.read_text(), module, path.name == "__init__.py"):
            if target in files and target != module:
                edges.setdefault(target, (path, line))
    return graph


def find_cycle(graph: dict[str, dict[str, tuple[Path, int]]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_imports_point_down():
    problems = [p for path in source_files() for p in layer_violations(path, path.read_text())]
    assert not problems, "upward or sideways imports:\n" + "\n".join(problems)


def test_no_import_circles():
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle:
        steps = [f"{a} -> {b} ({graph[a][b][0].relative_to(ROOT)}:{graph[a][b][1]})" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import circle:\n" + "\n".join(steps))


@pytest.mark.parametrize("source, expected", [
    ("from pdserve.router.config import RouterConfig\n", "prefill_worker/ imports 'pdserve.router.config'"),
    ("def f():\n    from pdserve.deploy import cli\n", "prefill_worker/engine.py:2: prefill_worker/ imports"),
    ("import model.loader\n", "imports 'model.loader' by its folder name"),
    ("from ..decode_worker import engine\n", "imports 'pdserve.decode_worker'"),
    ("from pdserve.model.loader import load_model\nfrom pdserve.cluster import secret\n", None),
])
def test_the_check_catches_upward_imports(source, expected):
    """The checker itself: a role importing a sibling, the launcher (even lazily) or a bare folder name fails."""
    problems = layer_violations(ROOT / "prefill_worker" / "engine.py", source)
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems


def test_the_check_finds_circles():
    a, b = ROOT / "model" / "a.py", ROOT / "model" / "b.py"
    graph = {"pdserve.model.a": {"pdserve.model.b": (a, 3)}, "pdserve.model.b": {"pdserve.model.a": (b, 9)},
             "pdserve.model.c": {"pdserve.model.a": (a, 1)}}
    assert find_cycle(graph) == ["pdserve.model.a", "pdserve.model.b", "pdserve.model.a"]
    assert find_cycle({"pdserve.model.a": {"pdserve.model.b": (a, 3)}, "pdserve.model.b": {}}) is None
