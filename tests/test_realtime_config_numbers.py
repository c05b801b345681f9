"""Realtime frames and session numbers go through the same finite/range checks as the chat body."""

from __future__ import annotations

import math

import pytest

from gateway.realtime.config import parse_session
from gateway.realtime.errors import RealtimeError
from gateway.realtime.routes import _parse_frame

TEXT_ONLY = {"modalities": ["text"]}


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_frame_values_name_their_path(token: str) -> None:
    frame = '{"type": "session.update", "session": {"temperature": %s}}' % token  # noqa: UP031
    with pytest.raises(RealtimeError) as info:
        _parse_frame(frame, 1 << 20)
    assert info.value.code == "invalid_value" and info.value.param == "session.temperature"
    assert info.value.body()["type"] == "invalid_request_error"


def test_malformed_frames_are_typed_errors() -> None:
    for text, code in (("{", "invalid_json"), ("[" * 200 + "]" * 200, "invalid_json"), ("[]", "bad_event")):
        with pytest.raises(RealtimeError) as info:
            _parse_frame(text, 1 << 20)
        assert info.value.code == code, text


@pytest.mark.parametrize(
    "session, param",
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 3.5}, "temperature"),
        ({"temperature": "warm"}, "temperature"),
        ({"idle_timeout_s": 0}, "idle_timeout_s"),
        ({"idle_timeout_s": -math.inf}, "idle_timeout_s"),
        ({"max_response_output_tokens": 0}, "max_response_output_tokens"),
        ({"max_response_output_tokens": 2**40}, "max_response_output_tokens"),
        ({"extra_body": {"max_response_units": 0}}, "extra_body.max_response_units"),
        ({"extra_body": {"force_listen_count": math.nan}}, "extra_body.force_listen_count"),
    ],
)
def test_session_numbers_are_checked_and_named(session: dict, param: str) -> None:
    with pytest.raises(RealtimeError) as info:
        parse_session({**TEXT_ONLY, **session})
    assert info.value.code == "invalid_session_config" and info.value.param == param, info.value.message


def test_good_session_numbers_apply() -> None:
    cfg = parse_session(
        {
            **TEXT_ONLY,
            "temperature": 0.7,
            "idle_timeout_s": 12,
            "max_response_output_tokens": "inf",
            "extra_body": {"max_response_units": 3, "force_listen_count": 2},
        }
    )
    assert (cfg.temperature, cfg.idle_timeout_s, cfg.max_response_output_tokens) == (0.7, 12.0, None)
    assert (cfg.max_response_units, cfg.force_listen_count) == (3, 2)
    assert parse_session({**TEXT_ONLY, "max_response_output_tokens": 64}).max_response_output_tokens == 64
