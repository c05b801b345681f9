"""FastAPI app factory and the gateway CLI (``python -m gateway``).

Routes: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``, plus the
realtime WebSocket when :mod:`gateway.realtime` provides ``mount_realtime(app)``.

Mounting other routers: pass them to :func:`create_app` (``extra_routers``) or, for the realtime module,
define ``gateway.realtime.mount_realtime(app: FastAPI) -> None``; handlers reach the shared stage
connections at request time through ``request.app.state.runtime`` (a :class:`GatewayRuntime`:
``.stages`` is the :class:`~gateway.stage_clients.StageSet`, ``.config.profile`` the deploy profile,
``.acquire()/.release()`` the shared concurrency slots, ``.check_api_key(header)`` the auth check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import importlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import logs, metrics
from gateway.audio import router as audio_router
from gateway.audio.voices import VoiceRegistry
from gateway.auth import API_KEY_ENV, ApiKeyError, check_api_key, is_loopback, resolve_api_key
from gateway.config import GatewayConfig
from gateway.openai.body import BodyStalled, ClientGone, idle_limited
from gateway.openai.chat import OPENAPI_COMPONENTS
from gateway.openai.chat import router as chat_router
from gateway.openai.errors import APIError, error_body, error_response, invalid_request, model_not_found
from gateway.openai.request_models import describe_error, error_loc
from gateway.runtime import GatewayRuntime
from gateway.shutdown import GRACEFUL_SHUTDOWN_S, GatewayServer
from services.common.deploy_profile import load_profile
from services.common.deploy_schema import ProfileError, port_arg
from services.common.heap import prepare_heap_for_serving
from services.common.tls import ClientTLS

log = logging.getLogger(__name__)
_PUBLIC_PATHS = ("/health", "/metrics")
_REQUEST_ID_CHARS = re.compile(r"[A-Za-z0-9._:-]+")


class _AuthAndCountMiddleware:
    """API-key check for ``/v1/*`` and per-route request counting, as plain ASGI.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware wraps ``receive``,
    which hides the client's disconnect from the route (``request.is_disconnected()``), and the chat
    route relies on it to cancel stage work when a non-streaming client goes away.
    """

    def __init__(self, app: ASGIApp, config: GatewayConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        request_id = _request_id(headers.get(b"x-request-id", b""))
        # Every log line of this request carries the id. It is not reset on the way out: the server runs
        # each request in a task of its own (a context of its own), and the lines logged about the
        # request after this middleware returns (Starlette's error handler, uvicorn's) must carry it too.
        logs.bind_request_id(request_id)
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)  # the socket checks the key itself
        else:
            await self._http(scope, receive, send, headers, request_id)

    async def _http(
        self, scope: Scope, receive: Receive, send: Send, headers: dict[bytes, bytes], request_id: str
    ) -> None:
        path: str = scope["path"]
        status = {"code": 500}

        async def send_counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        routed = False
        try:
            authorization = headers.get(b"authorization", b"").decode("latin-1") or None
            if path.startswith("/v1/") and not check_api_key(self.config, authorization):
                err = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)")
                await error_response(err)(scope, receive, send_counting)
            else:
                routed = True
                await self.app(scope, idle_limited(receive, self.config.body_idle_timeout), send_counting)
        finally:
            if path not in _PUBLIC_PATHS:
                metrics.REQUESTS.labels(_route_label(scope, routed), str(status["code"])).inc()


def _route_label(scope: Scope, routed: bool) -> str:
    """The ``route`` label of a request: its route's template (``/v1/audio/voices/{name}``), so that the
    label set stays bounded whatever paths clients send: ``unauthorized`` for a request refused before
    routing (no API key), ``unmatched`` for a ``/v1/`` path no route serves, ``other`` outside ``/v1/``."""
    if not routed:
        return "unauthorized"
    template = getattr(scope.get("route"), "path", None)  # the router sets it on the scope it was given
    if isinstance(template, str) and template.startswith("/v1/"):
        return template
    return "unmatched" if scope["path"].startswith("/v1/") else "other"


def _request_id(given: bytes) -> str:
    """The client's ``X-Request-Id`` when it is a short token, else a fresh one (never raw client bytes)."""
    text = given.decode("latin-1")
    if 0 < len(text) <= 64 and _REQUEST_ID_CHARS.fullmatch(text):
        return text
    return f"req-{uuid.uuid4().hex}"


def _mount_realtime(app: FastAPI) -> None:
    try:
        module = importlib.import_module("gateway.realtime")
    except ImportError as exc:
        log.info("realtime WebSocket not mounted: %s", exc)
        return
    mount = getattr(module, "mount_realtime", None)
    if mount is not None:
        mount(app)


def create_app(
    config: GatewayConfig, extra_routers: Sequence[APIRouter] = (), mount_realtime: bool = True
) -> FastAPI:
    """Build the gateway app; stage channels are opened in the lifespan (inside the server's loop)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = GatewayRuntime.build(config, created=int(time.time()))
        app.state.runtime = runtime
        runtime.monitor.start()
        info_task = asyncio.create_task(_fetch_info(runtime))
        try:
            yield
        finally:
            info_task.cancel()
            await runtime.monitor.stop()
            await runtime.stages.close()

    app = FastAPI(title="MiniCPM-o 4.5 gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    app.state.voices = VoiceRegistry(config.profile.gateway.voice_dir)  # before the realtime mount

    _install_error_handlers(app)
    app.add_middleware(_AuthAndCountMiddleware, config=config)

    def model_card(runtime: GatewayRuntime) -> dict[str, object]:
        return {
            "id": config.model_name,
            "object": "model",
            "created": runtime.created,
            "owned_by": "minicpmo-serve",
            "root": config.model_name,
            "max_model_len": config.profile.stage("thinker").max_model_len,
        }

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, object]:
        return {"object": "list", "data": [model_card(request.app.state.runtime)]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(request: Request, model: str) -> dict[str, object]:
        """OpenAI's "retrieve model" (``client.models.retrieve``); the served id holds a slash, which the
        SDK sends unescaped, hence the path converter."""
        if model != config.model_name:
            raise model_not_found(model, config.model_name)
        return model_card(request.app.state.runtime)

    @app.get("/health")
    async def health(request: Request) -> Response:
        runtime: GatewayRuntime = request.app.state.runtime
        if runtime.draining:  # readiness goes false first, so load balancers stop routing here
            return JSONResponse({"status": "shutting_down", "stages": {}}, 503)
        # The background probes' view (answers at once, unless a stream just failed: then after the
        # re-probe). A stage with some replicas down still serves: "degraded", 200, the bad ones named.
        reports = await runtime.monitor.report()
        serving = all(r.serving for r in reports.values())
        degraded = any(r.summary != "ok" for r in reports.values())
        status = "unhealthy" if not serving else "degraded" if degraded else "healthy"
        body = {
            "status": status,
            "stages": {name: r.summary for name, r in reports.items()},
            "replicas": {name: r.replicas for name, r in reports.items()},
        }
        return JSONResponse(body, 200 if serving else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(chat_router)
    app.include_router(audio_router)
    _declare_body_schemas(app)
    for router in extra_routers:
        app.include_router(router)
    if mount_realtime:
        _mount_realtime(app)
    return app


# What a client that calls another OpenAI endpoint (/v1/responses, /v1/completions, /v1/embeddings, ...)
# is told to use instead: every route family this gateway answers.
SERVED_ROUTES = (
    "POST /v1/chat/completions (text and speech out), POST /v1/audio/speech, /v1/audio/transcriptions, "
    "/v1/audio/translations, /v1/audio/voices, GET /v1/models, WebSocket /v1/realtime"
)


def _install_error_handlers(app: FastAPI) -> None:
    """Every refusal in the OpenAI error envelope; an unexpected exception is a 500 naming only its type."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        # The client left mid-body: nobody reads this answer; 499 (nginx's "client closed request") labels
        # it in minicpmo_gateway_requests_total so that it never counts as a server error.
        metrics.CLIENT_DISCONNECTS.inc()
        log.info("%s %s: %s", request.method, request.url.path, exc)
        return Response(status_code=499)

    @app.exception_handler(BodyStalled)
    async def _body_stalled(request: Request, exc: BodyStalled) -> Response:
        # The rest of the body may still come: the connection cannot be reused, so it is closed.
        log.info("%s %s: %s", request.method, request.url.path, exc)
        err = invalid_request(str(exc), None, "request_timeout", status=408)
        err.headers = {"Connection": "close"}
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        # The routes FastAPI validates (the audio endpoints' JSON and form bodies, query parameters) word
        # their refusals as the chat body's do: the field's path, OpenAI's reason code, what was wrong.
        errors = exc.errors()
        if not errors:
            return error_response(invalid_request("invalid request", None))
        loc = error_loc(errors[0])
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        param, code, message = describe_error(errors[0], loc)
        return error_response(invalid_request(message if param else f"request body: {message}", param, code))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if isinstance(exc.__cause__, BodyStalled):  # FastAPI's form parsing wraps it in a 400
            return await _body_stalled(request, exc.__cause__)
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # no route matched: say what is served
            message = (
                f"{request.method} {request.url.path[:200]} is not a route of this server; it serves "
                f"{SERVED_ROUTES} (docs/api.md)"
            )
        return JSONResponse(error_body(exc.status_code, message), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        # Answered outside the request middleware: the request id header is added here. Starlette
        # re-raises after this answer and uvicorn then drops the socket: say so, so a kept-alive client
        # opens a new connection instead of failing its next request on a reset.
        headers = {"Connection": "close"}
        request_id = logs.current_request_id()
        if request_id:
            headers["x-request-id"] = request_id
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), 500, headers=headers)


def _declare_body_schemas(app: FastAPI) -> None:
    """Add the chat request body's component schemas to /openapi.json (the route refers to them)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(OPENAPI_COMPONENTS)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


async def _fetch_info(runtime: GatewayRuntime) -> None:
    """Read each stage's GetInfo once it is reachable (for logs and compatibility checks); never fatal."""
    for _ in range(60):
        info = await runtime.stages.fetch_info()
        runtime.stage_info = {k: v for k, v in info.items() if v is not None}
        for name, msg in info.items():
            if msg is not None and msg.protocol_version and msg.protocol_version != "minicpmo.v1":
                log.error("%s speaks %s, the gateway speaks minicpmo.v1", name, msg.protocol_version)
        if all(v is not None for v in info.values()):
            return
        await asyncio.sleep(5)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gateway", description="MiniCPM-o 4.5 OpenAI-compatible gateway"
    )
    p.add_argument("--thinker-addr", default="127.0.0.1:50051", help="host:port, dns:///name:port or ip list")
    p.add_argument("--talker-addr", default="127.0.0.1:50052")
    p.add_argument("--code2wav-addr", default="127.0.0.1:50053")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback; a non-loopback address needs an API key or --allow-insecure)",
    )
    p.add_argument(
        "--allow-insecure",
        action="store_true",
        help="serve a non-loopback address without an API key (anyone who can reach it may use it)",
    )
    p.add_argument("--port", type=port_arg, default=8099)
    p.add_argument(
        "--deploy-config", default=None, help="deploy profile file or bundled name (default minicpmo_4_5)"
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id clients must send (default openbmb/MiniCPM-o-4_5)"
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help=f"file whose first line is the API key required as Authorization: Bearer <key> on /v1/* "
        f"(or set {API_KEY_ENV}; default: no key)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"the API key itself (discouraged: every local user can read a command line; use "
        f"{API_KEY_ENV} or --api-key-file)",
    )
    p.add_argument(
        "--allowed-media-root", default=None, help="directory under which file:// media may be read"
    )
    p.add_argument("--enable-http-fetch", action="store_true", help="allow http(s) media URLs")
    p.add_argument("--max-concurrent-requests", type=int, default=None)
    p.add_argument(
        "--max-realtime-sessions",
        type=int,
        default=None,
        help="duplex WebSocket sessions admitted at once (default: the profile's, 4 if unset)",
    )
    p.add_argument("--max-body-bytes", type=int, default=None)
    p.add_argument(
        "--voice-dir",
        default=None,
        help="directory of registered voices (/v1/audio/voices; default: the profile's gateway.voice_dir)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=None, help="seconds per request (stage deadlines)"
    )
    p.add_argument(
        "--drain-grace",
        type=float,
        default=None,
        help="seconds in-flight requests may finish after SIGTERM (default: the profile's drain_grace_s, 30)",
    )
    p.add_argument(
        "--stage-tls-ca",
        default=None,
        help="connect to the stages over TLS, verifying them against this CA (PEM; default: profile tls)",
    )
    p.add_argument(
        "--stage-tls-cert", default=None, help="mutual TLS: the gateway's client certificate (PEM)"
    )
    p.add_argument("--stage-tls-key", default=None, help="mutual TLS: the key of --stage-tls-cert (PEM)")
    p.add_argument("--log-level", default="info")
    return p


def _profile(args: argparse.Namespace) -> Any:
    profile = load_profile(args.deploy_config)
    if getattr(args, "voice_dir", None):
        profile = profile.with_overrides({"gateway": {"voice_dir": args.voice_dir}})
    return profile


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        stage_addrs={
            "thinker": args.thinker_addr,
            "talker": args.talker_addr,
            "code2wav": args.code2wav_addr,
        },
        profile=_profile(args),
        served_model_name=args.served_model_name,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        allowed_media_root=Path(args.allowed_media_root) if args.allowed_media_root else None,
        http_fetch=args.enable_http_fetch,
        max_concurrent_requests=args.max_concurrent_requests,
        max_realtime_sessions=args.max_realtime_sessions,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout,
        drain_grace_s=args.drain_grace,
        stage_tls=ClientTLS(args.stage_tls_ca, args.stage_tls_cert, args.stage_tls_key)
        if args.stage_tls_ca
        else None,
    )


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    faulthandler.enable()  # a native crash (SIGSEGV in a C extension) prints every thread's stack
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, process="gateway")
    try:
        config = config_from_args(args)
    except (ProfileError, ApiKeyError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    if not is_loopback(args.host) and not config.api_key and not args.allow_insecure:
        raise SystemExit(
            f"error: refusing to serve {args.host} (not loopback) without an API key: set {API_KEY_ENV} "
            "or --api-key-file, or pass --allow-insecure to serve it open"
        )
    app = create_app(config)
    server = GatewayServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            log_config=None,  # uvicorn's loggers go through the JSON handler of gateway.logs
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        ),
        app,
        grace_s=config.drain_grace,
    )
    prepare_heap_for_serving()  # imports and app out of the GC's full passes (services.common.heap)
    server.run()
