"""The gateway's API key: where it comes from, and the check shared by the HTTP middleware
(gateway.app) and the realtime WebSocket.

The key never has to be on a command line (where every local user can read it with ``ps``): it comes
from the ``MINICPMO_API_KEY`` environment variable or from a file (``--api-key-file``, first line);
``--api-key`` still works but is discouraged. The check is constant-time (``hmac.compare_digest``).

Its own module so that the routes and the runtime can reach it without importing the app factory (which
imports them: that was an import cycle).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from pathlib import Path

from gateway.config import GatewayConfig

API_KEY_ENV = "MINICPMO_API_KEY"


class ApiKeyError(ValueError):
    """The configured key source cannot be used (unreadable or empty file)."""


def resolve_api_key(
    flag_value: str | None, key_file: str | None, environ: dict[str, str] | None = None
) -> str | None:
    """The API key: ``--api-key-file`` first, then ``--api-key``, then ``$MINICPMO_API_KEY``; None: no key."""
    env = os.environ if environ is None else environ
    if key_file:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ApiKeyError(f"cannot read --api-key-file {key_file}: {exc.strerror}") from exc
        key = text.splitlines()[0].strip() if text.strip() else ""
        if not key:
            raise ApiKeyError(f"--api-key-file {key_file} is empty")
        return key
    if flag_value:
        return flag_value
    return env.get(API_KEY_ENV) or None


def is_loopback(host: str) -> bool:
    """True when ``host`` (an address or a name) only accepts connections from this machine."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_api_key(config: GatewayConfig, authorization: str | None) -> bool:
    """True when no key is configured or ``authorization`` is ``Bearer <key>`` (compared in constant time)."""
    if not config.api_key:
        return True
    if not authorization or not authorization.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(authorization[7:].strip().encode(), config.api_key.encode())
