"""Browser client for the realtime duplex WebSocket.

    python -m examples.online_serving.minicpmo.realtime_web --port 8080 \
        --ws-backend ws://127.0.0.1:8099/v1/realtime --ref-audio voice.wav [--public-realtime-url URL]

Serves a page that captures the microphone (an AudioWorklet; 16 kHz pcm16 appends every 200 ms), plays
the 24 kHz replies, and shows the transcript. "model decides when to speak" picks the native lane; unchecked,
the session is in the turn lane and "Answer now" commits the speech so far and asks for the reply. The page talks to ``/v1/realtime`` on its own origin; this server
proxies that WebSocket to ``--ws-backend`` frame by frame, so the browser never needs to reach the
gateway directly (no CORS, one port to expose). ``--public-realtime-url`` makes the page connect
somewhere else instead (e.g. a gateway behind its own TLS ingress).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
from pathlib import Path
from urllib.parse import urlencode

from fastapi import FastAPI, WebSocket
from fastapi.responses import FileResponse, JSONResponse
from starlette.websockets import WebSocketDisconnect

STATIC = Path(__file__).with_name("static")


def create_app(ws_backend: str, ref_audio: Path, public_realtime_url: str | None = None) -> FastAPI:
    app = FastAPI(title="MiniCPM-o realtime web client", docs_url=None, redoc_url=None)
    ref_uri = "data:audio/wav;base64," + base64.b64encode(ref_audio.read_bytes()).decode()

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/app.js")
    async def script() -> FileResponse:
        return FileResponse(STATIC / "app.js", media_type="text/javascript")

    @app.get("/capture-worklet.js")
    async def capture_worklet() -> FileResponse:
        # AudioWorklet module: loaded by ctx.audioWorklet.addModule() from the page's own origin
        return FileResponse(STATIC / "capture-worklet.js", media_type="text/javascript")

    @app.get("/config.json")
    async def config() -> JSONResponse:
        return JSONResponse({"realtime_url": public_realtime_url, "ref_audio": ref_uri})

    @app.websocket("/v1/realtime")
    async def proxy(ws: WebSocket) -> None:
        import websockets

        await ws.accept()
        query = urlencode(list(ws.query_params.multi_items()))
        target = ws_backend + (("&" if "?" in ws_backend else "?") + query if query else "")
        try:
            upstream = await websockets.connect(target, max_size=None)
        except Exception as exc:  # noqa: BLE001 - tell the page why, in the protocol's own envelope
            await ws.send_text(
                json.dumps(
                    {
                        "type": "error",
                        "error": {"type": "server_error", "code": "backend_unavailable", "message": str(exc)},
                    }
                )
            )
            await ws.close(1011)
            return

        async def client_to_backend() -> None:
            with contextlib.suppress(WebSocketDisconnect):
                while True:
                    message = await ws.receive()
                    if message["type"] == "websocket.disconnect":
                        return
                    if message.get("text") is not None:
                        await upstream.send(message["text"])
                    elif message.get("bytes") is not None:
                        await upstream.send(message["bytes"])

        async def backend_to_client() -> None:
            with contextlib.suppress(Exception):
                async for frame in upstream:
                    if isinstance(frame, str):
                        await ws.send_text(frame)
                    else:
                        await ws.send_bytes(frame)
            with contextlib.suppress(Exception):
                await ws.close(upstream.close_code or 1000)

        tasks = [asyncio.create_task(client_to_backend()), asyncio.create_task(backend_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await upstream.close()

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(
        prog="python -m examples.online_serving.minicpmo.realtime_web",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--ws-backend", default="ws://127.0.0.1:8099/v1/realtime")
    p.add_argument("--ref-audio", required=True, type=Path, help="WAV with the reply voice")
    p.add_argument(
        "--public-realtime-url", default=None, help="WebSocket URL the page should use instead of the proxy"
    )
    args = p.parse_args(argv)
    uvicorn.run(
        create_app(args.ws_backend, args.ref_audio, args.public_realtime_url), host=args.host, port=args.port
    )


if __name__ == "__main__":
    main()
