"""Container health check for the gateway: GET its liveness endpoint on loopback; exit 0 on HTTP 200.

python /opt/minicpmo/docker/http_health_probe.py [--port P] [--path /health] [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("MINICPMO_HTTP_PORT", "8099")))
    parser.add_argument("--path", default=os.environ.get("MINICPMO_HEALTH_PATH", "/health"))
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}{args.path}"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as reply:
            status = reply.status
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}")
        return 1
    print(f"{url}: {status}")
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
