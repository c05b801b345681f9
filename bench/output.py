"""How a benchmark hands over its result: indented JSON on stdout, then its Markdown table, and the same
JSON in a file when asked (the GPU recipes keep the file, the log keeps the table)."""

from __future__ import annotations

import json
from typing import Any


def publish(result: dict[str, Any], table: str, out: str | None) -> None:
    """Print ``result`` as JSON, a blank line and ``table``; write the JSON to ``out`` too, if given."""
    print(json.dumps(result, indent=2))
    print()
    print(table)
    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=2)
