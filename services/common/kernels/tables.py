"""Measured launch configs added to the GEMM kernels' built-in tables from sweep files.

The thinker's profile keys ``kernel_table`` and ``fp8_table`` (and ``bench.thinker``'s flags of the same
names) name a skinny-GEMM and an fp8-GEMM sweep file; :func:`load_tables` reads both (through
:func:`.tuned.read_best`) into the kernels' tables before any graph captures a launch. A module of its own
because it imports both kernels, which import :mod:`.tuned`.
"""

from __future__ import annotations


def load_tables(skinny_table: str | None, fp8_table: str | None) -> list[tuple[str, str, int]]:
    """Add the measured configs of a skinny-GEMM and an fp8-GEMM sweep file (either may be None) to the
    kernels' built-in tables, before any graph captures them; returns ``(kernel, path, entries)`` per file
    loaded. Raises ValueError naming the file when it is not such a sweep. The kernel modules (and Triton)
    are imported only when a file is named."""
    if not (skinny_table or fp8_table):
        return []
    from services.common.kernels import fp8_gemm, skinny

    loaded = []
    for path, kernel, use in (
        (skinny_table, "skinny-GEMM", skinny.use_table),
        (fp8_table, "fp8 GEMM", fp8_gemm.use_table),
    ):
        if path:
            loaded.append((kernel, path, use(path)))
    return loaded
