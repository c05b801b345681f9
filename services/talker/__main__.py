"""CLI: ``python -m services.talker --checkpoint DIR --device cpu|cuda[:N] --port P`` serves the stage;
``python -m services.talker dump --checkpoint DIR --out FILE.npz`` writes the fidelity arrays."""

from __future__ import annotations

import sys


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "dump":
        from services.talker.dump import main as dump_main

        dump_main(sys.argv[2:])
        return
    from services.talker.server import main as serve_main

    serve_main(sys.argv[1:])


if __name__ == "__main__":
    main()
