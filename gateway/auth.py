"""The gateway's API-key check, shared by the HTTP middleware (gateway.app) and the realtime WebSocket.

Its own module so that the routes and the runtime can reach it without importing the app factory (which
imports them: that was an import cycle).
"""

from __future__ import annotations

import hmac

from gateway.config import GatewayConfig


def check_api_key(config: GatewayConfig, authorization: str | None) -> bool:
    """True when no key is configured or ``authorization`` is ``Bearer <key>``."""
    if not config.api_key:
        return True
    if not authorization or not authorization.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(authorization[7:].strip().encode(), config.api_key.encode())
