"""No import cycles in ``gateway/`` and ``services/``, and no stage that leans on another: a small AST walk
over the sources, so neither can come back.

Each stage (``services.thinker``, ``services.talker``, ``services.code2wav``) stands alone: it imports
``services.common`` and itself, never another stage, so a stage's image and its tests need no other
stage's code and changing one stage's internals cannot break another. ``services.common`` and the gateway
import no stage at all. The same holds for the wire contract: each stage's proto imports only
``common.proto``.

An edge ``a -> b`` is any ``import``/``from ... import`` (or ``importlib.import_module`` of a literal name)
in ``a`` of a module of these packages: at module level, inside functions (a function-local import only defers a cycle, it does not break it) and under
``if TYPE_CHECKING:`` (such an import never runs, but two modules whose annotations name each other still
each need the other to be understood; a part that calls back into its owner names a protocol instead,
e.g. ``gateway.realtime.host``). ``from pkg import name`` is an edge to ``pkg.name`` when that is a
module, else to ``pkg`` itself; the implicit import of parent packages is not an edge (as in grimp), since
it would make every ``__init__`` that mounts its submodules look like a cycle.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "services")
STAGES = ("services.thinker", "services.talker", "services.code2wav")


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the given top-level packages."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import(node: ast.AST) -> str | None:
    """The module of ``importlib.import_module("a.b")`` / ``import_module("a.b")`` with a literal name."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    value = node.args[0].value
    return value if name == "import_module" and isinstance(value, str) and not value.startswith(".") else None


def _imports(tree: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import node that can execute (``if TYPE_CHECKING:`` bodies skipped, their ``else`` kept);
    with ``type_checking``, the annotation-only ones too. ``importlib.import_module`` of a literal name
    counts as ``import name``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        dynamic = _dynamic_import(node)
        if dynamic is not None:
            yield ast.Import(names=[ast.alias(name=dynamic)])
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(
    root: Path, packages: tuple[str, ...] = PACKAGES, *, type_checking: bool = False
) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports at run time (with ``type_checking``: or names in
    annotations)."""
    modules = _modules(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path)), type_checking):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, is_package, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted, in name order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def test_gateway_and_services_have_no_import_cycle() -> None:
    graph = import_graph(ROOT, type_checking=True)
    assert "gateway.app" in graph and "services.common.deploy_profile" in graph  # the walk saw the tree
    assert cycles(graph) == []


def owner(module: str) -> str:
    """The part a module belongs to: one of :data:`STAGES`, ``services.common``, ``gateway`` (or the
    module's top-level package, for trees other than this one)."""
    for part in (*STAGES, "services.common", "gateway"):
        if module == part or module.startswith(part + "."):
            return part
    return module.split(".")[0]


def cross_stage_imports(graph: dict[str, set[str]], stages: tuple[str, ...] = STAGES) -> list[str]:
    """``a -> b`` for every import of a stage module ``b`` by a module ``a`` outside that stage."""
    found: list[str] = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            stage = next((s for s in stages if target == s or target.startswith(s + ".")), None)
            if stage is not None and not (module == stage or module.startswith(stage + ".")):
                found.append(f"{module} -> {target}")
    return found


def test_no_module_imports_another_stage() -> None:
    """Function-level imports and annotation-only imports count: either would tie the stages together."""
    graph = import_graph(ROOT, type_checking=True)
    assert {owner(m) for m in graph} >= {*STAGES, "services.common", "gateway"}  # the walk saw each part
    assert cross_stage_imports(graph) == []


def test_each_stage_proto_imports_only_common() -> None:
    protos = ROOT / "protos" / "minicpmo" / "v1"
    imports = {
        path.stem: sorted(re.findall(r'^import\s+"([^"]+)";', path.read_text(encoding="utf-8"), re.MULTILINE))
        for path in sorted(protos.glob("*.proto"))
    }
    assert set(imports) == {"common", "thinker", "talker", "code2wav"}
    assert imports["common"] == []
    for stage in ("thinker", "talker", "code2wav"):
        assert imports[stage] == ["minicpmo/v1/common.proto"], (stage, imports[stage])


def test_a_cross_stage_import_is_found(tmp_path: Path) -> None:
    """A stage reaching into another, even from inside a function or under ``TYPE_CHECKING``, and common
    code reaching into a stage, are reported; imports of common and of the stage itself are not."""
    _write(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/common/__init__.py": "",
            "services/common/k.py": "def f():\n    from services.thinker import t\n",
            "services/thinker/__init__.py": "",
            "services/thinker/t.py": "from services.common import k\nfrom . import u\n",
            "services/thinker/u.py": "",
            "services/talker/__init__.py": "",
            "services/talker/a.py": "def g():\n    import services.thinker.u\n",
            "services/talker/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.code2wav import c\n",
            "services/code2wav/__init__.py": "",
            "services/code2wav/c.py": "from services.common.k import f\n",
            "services/code2wav/d.py": "import importlib\nm = importlib.import_module('services.talker.a')\n",
        },
    )
    graph = import_graph(tmp_path, ("services",), type_checking=True)
    assert cross_stage_imports(graph) == [
        "services.code2wav.d -> services.talker.a",
        "services.common.k -> services.thinker.t",
        "services.talker.a -> services.thinker.u",
        "services.talker.b -> services.code2wav.c",
    ]


def test_the_realtime_pipeline_does_not_know_the_session() -> None:
    """The duplex pipeline reports through ``PipelineHost.post_pipeline``; not even its annotations may name
    the session, the commands or the response lifecycle (they would pull the session's state into it)."""
    graph = import_graph(ROOT, ("gateway",), type_checking=True)
    pipeline = [m for m in graph if m.startswith("gateway.realtime.pipeline")]
    assert len(pipeline) >= 4
    owners = {
        "gateway.realtime.session",
        "gateway.realtime.commands",
        "gateway.realtime.lifecycle",
        "gateway.realtime.server_vad",
        "gateway.realtime.registry",
        "gateway.realtime.routes",
    }
    assert {m: sorted(graph[m] & owners) for m in pipeline} == {m: [] for m in pipeline}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_deliberate_cycle_is_found(tmp_path: Path) -> None:
    """The check fails on the shapes a cycle takes: a local import inside a function, a relative
    ``from . import``, a ``from pkg import module``; and stays quiet on a ``TYPE_CHECKING`` back-reference."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import thing\n",
            "pkg/b.py": "def thing():\n    from . import c\n    return c\n",
            "pkg/c.py": "import pkg.a\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/x.py": "from pkg.sub import y\n",
            "pkg/sub/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import x\n",
            "pkg/sub/z.py": "from ..sub import w\n",
            "pkg/sub/w.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from pkg.sub.z import q\n",
        },
    )
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.b"] == {"pkg.c"} and graph["pkg.sub.y"] == set()
    assert import_graph(tmp_path, ("pkg",), type_checking=True)["pkg.sub.y"] == {"pkg.sub.x"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.sub.w", "pkg.sub.z"]]


def test_an_acyclic_tree_passes(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {"pkg/__init__.py": "from pkg import a\n", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "import os\n"},
    )
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert cycles(graph) == []
