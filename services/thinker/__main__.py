"""``python -m services.thinker``: ``dump`` runs the fidelity dump (``dump --duplex`` the duplex session), anything else starts the stage server."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "dump" and "--duplex" in args:
        from services.thinker.duplex_dump import main as duplex_dump_main

        return duplex_dump_main([a for a in args[1:] if a != "--duplex"])
    if args and args[0] == "dump":
        from services.thinker.dump import main as dump_main

        return dump_main(args[1:])
    from services.thinker.server import main as server_main  # imported lazily: the dump needs no gRPC

    return int(server_main(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
