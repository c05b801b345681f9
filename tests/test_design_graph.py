"""docs/design.md's package picture is the import graph: generated from the sources, compared with the doc.

The block between ``<!-- import-graph:begin -->`` and ``<!-- import-graph:end -->`` in docs/design.md lists,
for each package of the tree, the packages it imports (any ``import`` the AST walk of
:mod:`tests.test_import_cycles` sees: module level, inside functions, under ``TYPE_CHECKING``). A change
that adds or removes a dependency between packages fails here until the doc is regenerated:

    python -m tests.test_design_graph --write

The module map and the "where to look" table of the same document are checked too: every path they name
exists, every package of the graph and every module of ``services/common`` has a row, and every function
they name is defined in the file beside it.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.test_import_cycles import ROOT, import_graph

DESIGN = ROOT / "docs" / "design.md"
BEGIN = "<!-- import-graph:begin -->"
END = "<!-- import-graph:end -->"
# The packages of the picture, most specific first: a module belongs to the first that contains it.
PARTS = (
    "gateway.realtime.pipeline",
    "gateway.realtime",
    "gateway.openai",
    "gateway.audio",
    "gateway",
    "services.common.kernels",
    "services.common.pb",
    "services.common.checkpoint_tool",
    "services.common",
    "services.thinker",
    "services.talker",
    "services.code2wav",
)


def part_of(module: str) -> str:
    for part in PARTS:
        if module == part or module.startswith(part + "."):
            return part
    raise ValueError(f"{module} belongs to no part of the picture; add its package to PARTS")


def package_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Part -> the other parts its modules import."""
    graph: dict[str, set[str]] = {part: set() for part in PARTS}
    for module, targets in import_graph(root, type_checking=True).items():
        if module == "services":
            continue  # the namespace's empty __init__
        src = part_of(module)
        graph[src].update(part_of(t) for t in targets if t != "services" and part_of(t) != src)
    return graph


def render(graph: dict[str, set[str]]) -> str:
    width = max(len(p) for p in graph)
    lines = [f"{part:<{width}}  -> {', '.join(sorted(graph[part])) or '(nothing)'}" for part in PARTS]
    return "\n".join(["```text", *lines, "```"])


def _block(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def write(path: Path = DESIGN) -> bool:
    """Rewrite the block in ``path``; True when it changed."""
    text = path.read_text(encoding="utf-8")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = f"{text[:start]}\n{render(package_graph())}\n{text[end:]}"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def test_design_picture_is_the_import_graph() -> None:
    want = render(package_graph())
    assert _block(DESIGN.read_text(encoding="utf-8")) == want, (
        "docs/design.md's import graph is stale; run: python -m tests.test_design_graph --write"
    )


def test_the_picture_shows_stages_standing_alone() -> None:
    """Read off the generated graph: what a newcomer should see in it."""
    graph = package_graph()
    stages = {"services.thinker", "services.talker", "services.code2wav"}
    for stage in stages:
        assert not graph[stage] & (stages - {stage}), stage
    for part in PARTS:
        if part.startswith("services.common") or part.startswith("gateway"):
            assert not graph[part] & stages, part


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the first table under ``## heading``."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def _paths(cell: str) -> list[str]:
    return re.findall(r"`([\w./-]+/|[\w./-]+\.(?:py|proto|yaml|md))`", cell)


def test_module_map_names_real_paths_and_every_part() -> None:
    rows = _table_rows(DESIGN.read_text(encoding="utf-8"), "Module map")
    named = [p for row in rows for p in _paths(row[0])]
    assert named, "no paths in the module map"
    for name in named:
        target = ROOT / name.replace("*.proto", "")
        assert target.exists(), f"docs/design.md module map names a missing path: {name}"
    dirs = {p.rstrip("/") for p in named if p.endswith("/")}
    files = {p for p in named if not p.endswith("/")}
    for part in PARTS:
        folder = part.replace(".", "/")
        assert folder in dirs or part in ("gateway", "services.common"), f"no module map row for {folder}/"
    common = ROOT / "services" / "common"
    for module in sorted(common.glob("*.py")):
        rel = module.relative_to(ROOT).as_posix()
        assert module.name == "__init__.py" or rel in files, f"no module map row for {rel}"


def _defined(path: Path, dotted: str) -> bool:
    """Whether ``dotted`` (``func`` or ``Class.method``) is defined at the top of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    scope: list[ast.stmt] = tree.body
    for name in dotted.split("."):
        found = next(
            (
                node
                for node in scope
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and node.name == name
            ),
            None,
        )
        if found is None:
            return False
        scope = found.body
    return True


def test_where_to_look_points_at_real_functions() -> None:
    rows = _table_rows(DESIGN.read_text(encoding="utf-8"), "Where to look")
    assert len(rows) >= 3
    for question, where, what in rows:
        paths = _paths(where)
        names = re.findall(r"`([A-Za-z_][\w.]*)`", what)
        assert paths and names, question
        for name in names:
            assert any(_defined(ROOT / p, name) for p in paths), f"{question}: {name} not in {paths}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        print("docs/design.md updated" if write() else "docs/design.md already current")
    else:
        print(render(package_graph()))
