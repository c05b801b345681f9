"""A realtime speaking turn asks the talker for the deploy profile's first codec window, as the chat route
does: the gateway copies ``talker.codec.first_window_frames`` into its realtime settings, and each
speaking turn's ``TalkerOpen`` carries it (0, the upstream duplex framing, when no profile says)."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.realtime.pipeline.speech import SpeechTurn
from gateway.realtime.settings import RealtimeSettings
from services.common.deploy_profile import load_profile
from services.common.pb import talker_pb2


class _Recorder:
    """A stage stream that records what is written and never answers."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def write(self, msg: Any) -> None:
        self.sent.append(msg)

    async def responses(self):  # noqa: ANN201
        await asyncio.Event().wait()
        yield  # pragma: no cover

    def cancel(self) -> None:
        pass


class _Stage:
    def __init__(self) -> None:
        self.stream = _Recorder()

    def open_stream(self, deadline_s: float | None = None) -> _Recorder:
        return self.stream


def _talker_open(settings: RealtimeSettings) -> talker_pb2.TalkerOpen:
    stages = {"talker": _Stage(), "code2wav": _Stage()}

    async def run() -> talker_pb2.TalkerOpen:
        turn = SpeechTurn(
            session_id="s",
            epoch=0,
            turn_id=1,
            stages=stages,  # type: ignore[arg-type]
            settings=settings,
            ref_pcm=None,
            report=lambda event: None,
            on_failure=lambda *a: None,
            on_finished=lambda t: None,
        )
        assert await turn.start()
        turn.cancel()
        return stages["talker"].stream.sent[0].open

    return asyncio.run(run())


def test_first_window_from_the_profile_reaches_the_talker() -> None:
    profile = load_profile("minicpmo_4_5")
    frames = profile.stage("talker").codec.first_window_frames
    assert frames == 10  # the 1-GPU profile's value, which the chat route uses too
    app = create_app(GatewayConfig(profile=profile))
    assert app.state.realtime_settings.first_window_frames == frames
    assert _talker_open(app.state.realtime_settings).first_window_frames == frames
    assert _talker_open(RealtimeSettings()).first_window_frames == 0  # no profile: a full first window
