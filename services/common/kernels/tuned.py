"""Launch-config tables measured on a GPU: the row buckets they are keyed by and reading a sweep's file.

The skinny and fp8 GEMMs each carry a built-in table of ``(row bucket, N, K) -> config`` measured on one
card. On another card a deployment runs the kernel's microbench once (``bench.thinker.skinny`` or
``bench.thinker.fp8`` with ``--json-out``) and names the file in the thinker's profile (``kernel_table``,
``fp8_table``); :func:`read_best` turns that file into table entries, which win over the built-in ones
(:mod:`.tables` adds a process's files to the kernels' tables).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


def row_bucket(m: int) -> int:
    """The table key of ``m`` rows: 1, or the next power of two."""
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


def read_best(
    path: str | os.PathLike[str], make: Callable[..., C], fields: int
) -> dict[tuple[int, int, int], C]:
    """``{(row bucket, N, K): make(*best config)}`` for every entry of a sweep's ``--json-out`` file that
    has a winner. Raises ValueError naming the file and the entry when it is not such a file (a config
    of another kernel has another length), so a wrong path fails the stage at start, not at a launch."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"kernel table {path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(rows, list):
        raise ValueError(f"kernel table {path}: expected the list a sweep's --json-out writes")
    table: dict[tuple[int, int, int], C] = {}
    for i, r in enumerate(rows):
        try:
            if not r.get("best"):
                continue
            config: list[Any] = r["best"]["config"]
            key = (row_bucket(int(r["rows"])), int(r["n"]), int(r["k"]))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"kernel table {path}: entry {i} is not a sweep result ({exc!r})") from exc
        if not isinstance(config, list) or len(config) != fields:
            raise ValueError(
                f"kernel table {path}: entry {i} has config {config!r}; this kernel's configs have "
                f"{fields} fields (is it another kernel's table?)"
            )
        table[key] = make(*config)
    return table
