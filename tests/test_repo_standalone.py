"""The repository explains itself: no tracked file points at a document or path outside it, none is a
scratch script named after a work session, no prose or comment dates itself by "session N", and every
"docs/model.md, <Section>" / "docs/protocol.md, <Section>" / "BENCHMARKS.md, "<Section>"" pointer names a
heading that exists.

History lives in git; the facts the code relies on live in docs/model.md and docs/protocol.md.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {
    ".py", ".pyi", ".md", ".sh", ".txt", ".toml", ".yaml", ".yml", ".proto", ".cfg", ".ini", ".json",
    ".js", ".html", ".css", ".tpl", ".j2", ".jinja", "",
}  # fmt: skip
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Documents that are not in the repository, and paths that leave it. Each is given in two pieces so that
# this file, the one that lists them, does not itself name them.
_OUTSIDE = (
    ("model", "-spec"), ("wire", "-protocol"), ("anchors", ".md"), ("anchors", " §"), ("architecture", ".md"),
    ("platform", "-notes"), ("shared", "/specs"), ("../", "shared"), ("/work", "/shared"), ("/work", "/scratch"),
    ("oracle", " README"), ("the wire", " spec"),
)  # fmt: skip
OUTSIDE_REFERENCES = re.compile("|".join(re.escape(head + tail) for head, tail in _OUTSIDE))
# A document dating itself by the work session or device call it was written in.
SESSION_WORDING = re.compile(r"\bsession[ -]\d+\b|\bs\d+c\d+\b|\bsessions? \d+[–-]\d+ runs\b", re.IGNORECASE)


def tracked_files() -> list[str]:
    """Every file git tracks (the working tree's view, so uncommitted renames count)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked-file list is unknown")
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


def text_files() -> dict[str, str]:
    files = {}
    for rel in tracked_files():
        path = ROOT / rel
        if path.suffix not in TEXT_SUFFIXES or rel.startswith("tests/fixtures/") or rel == THIS_FILE:
            continue
        try:
            files[rel] = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
    return files


def _hits(pattern: re.Pattern[str], files: dict[str, str]) -> list[str]:
    found = []
    for rel, text in files.items():
        for n, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{rel}:{n}: {line.strip()[:140]}")
    return found


def headings(doc: str) -> list[str]:
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", text, re.MULTILINE)]


def test_no_scratch_gpu_scripts_are_tracked() -> None:
    scratch = [p for p in tracked_files() if p.startswith(".gpu/")]
    assert not scratch, f"scratch scripts belong in named recipes under bench/gpu/: {scratch}"


def test_no_reference_to_documents_outside_the_repository() -> None:
    hits = _hits(OUTSIDE_REFERENCES, text_files())
    assert not hits, "write the fact into docs/model.md or docs/protocol.md and point there:\n" + "\n".join(
        hits
    )


def test_no_session_numbered_wording() -> None:
    hits = _hits(SESSION_WORDING, text_files())
    assert not hits, "history lives in git; say what and why, not when:\n" + "\n".join(hits)


@pytest.mark.parametrize("doc", ["docs/model.md", "docs/protocol.md", "docs/fidelity.md"])
def test_section_pointers_name_existing_headings(doc: str) -> None:
    names = [h.lower() for h in headings(doc)]
    pointer = re.compile(re.escape(doc) + r", ([^\n]+)")
    bad = []
    for rel, text in text_files().items():
        for m in pointer.finditer(text):
            # the section name runs up to the first closing mark: "docs/model.md, Token ids)" -> "token ids"
            name = re.split(r"[)\].;:,`\"]", m.group(1).lower().lstrip("\"'`"), maxsplit=1)[0].strip()
            if not name or not any(name.startswith(h) or h.startswith(name) for h in names):
                bad.append(f"{rel}: {doc}, {m.group(1)[:60]}")
    assert not bad, f"no heading of {doc} matches:\n" + "\n".join(bad)


def test_benchmark_pointers_name_existing_headings() -> None:
    names = headings("BENCHMARKS.md")
    pointer = re.compile(r'BENCHMARKS\.md, "([^"]+)"')
    bad = [
        f"{rel}: {m.group(1)}"
        for rel, text in text_files().items()
        for m in pointer.finditer(text)
        if not any(h.startswith(m.group(1)) for h in names)
    ]
    assert not bad, "no BENCHMARKS.md heading starts with:\n" + "\n".join(bad)


def test_the_checks_catch_what_they_look_for() -> None:
    """The patterns themselves: each flags the wording it exists for and passes ordinary prose."""
    assert OUTSIDE_REFERENCES.search("see " + "".join(_OUTSIDE[0]) + " §3.2")
    assert OUTSIDE_REFERENCES.search("".join(_OUTSIDE[7]) + "/oracle")
    assert SESSION_WORDING.search("measured in session 11") and SESSION_WORDING.search(".gpu/s10c3.sh")
    assert not SESSION_WORDING.search("16 sessions × 30 s, one warm-up session first")
    assert not OUTSIDE_REFERENCES.search("docs/protocol.md, Realtime errors")
