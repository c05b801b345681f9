"""Malformed and hostile HTTP bodies through the real gateway app (uvicorn on a loopback port).

Every body here used to give ``500 internal error`` (or run silently to the context limit) and each now
must be a 4xx with the error envelope and a reason. All are refused before any stage is contacted, so
the stages are addresses nobody listens on. Each request goes over ONE kept-alive HTTP/1.1 connection:
after every refusal a follow-up request must be answered on the same socket (a 500 used to reset it).
"""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Iterator

import pytest
from gateway_server import ThreadedGateway
from media_samples import bomb_png, data_url, png_bytes
from stage_processes import dead_address

from gateway.config import GatewayConfig
from services.common.deploy_profile import load_profile

MODEL = "openbmb/MiniCPM-o-4_5"
ROUTE = "/v1/chat/completions"
_REPR = re.compile(r"object at 0x|<[^<>]* at 0x[0-9a-fA-F]+>")
MAX_MODEL_LEN = load_profile("cpu").stage("thinker").max_model_len


def _body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def _raw(**extra: object) -> bytes:
    return json.dumps(_body(**extra)).encode()


def _nested(depth: int) -> bytes:
    return b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "x": ' % MODEL.encode() + (
        b"[" * depth + b"]" * depth + b"}"
    )


@pytest.fixture(scope="module")
def gateway() -> Iterator[ThreadedGateway]:
    addrs = {s: dead_address() for s in ("thinker", "talker", "code2wav")}
    with ThreadedGateway(GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu"))) as gw:
        yield gw


@pytest.fixture()
def conn(gateway: ThreadedGateway) -> Iterator[http.client.HTTPConnection]:
    c = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    c.connect()
    yield c
    c.close()


def _post(
    conn: http.client.HTTPConnection, body: bytes, content_type: str | None = "application/json"
) -> tuple[int, dict]:
    headers = {"Content-Type": content_type} if content_type else {}
    conn.request("POST", ROUTE, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    assert not resp.will_close, "the server closed the kept-alive connection after answering"
    return resp.status, json.loads(data)


def _assert_still_usable(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    conn.request("GET", "/v1/models")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["data"][0]["id"] == MODEL
    assert conn.sock is sock, "the follow-up request needed a new connection"


BAD_BODIES = [
    # lone UTF-16 surrogates: JSON allows the escape, no UTF-8 encoder (protobuf, the response) does
    ("surrogate_in_content", _raw().replace(b'"hi"', b'"a\\ud800b"'), 400, "messages[0].content"),
    ("surrogate_in_model", _raw().replace(MODEL.encode(), b"\\udfff"), 400, "model"),
    ("surrogate_in_key", _raw().replace(b'"model"', b'"\\ud800", "model"'), 400, None),
    # nesting: a chat body nests ~6 deep
    ("nesting_100", _nested(100), 400, None),
    ("nesting_1000", _nested(1000), 400, None),
    ("nesting_100000", _nested(100_000), 400, None),
    # integers the stage protos cannot hold
    ("max_tokens_2^32", _raw(max_tokens=2**32), 400, "max_tokens"),
    ("seed_2^64", _raw(seed=2**64), 400, "seed"),
    ("top_k_2^31", _raw(top_k=2**31), 400, "top_k"),
    ("min_tokens_negative", _raw(min_tokens=-5), 400, "min_tokens"),
    ("n_huge", _raw(n=10**30), 400, "n"),
    (
        "stop_token_ids_negative",
        _raw(sampling_params_list=[{"stop_token_ids": [151645, -1]}]),
        400,
        "sampling_params_list[0].stop_token_ids[1]",
    ),
    (
        "stop_token_ids_2^31",
        _raw(sampling_params_list=[{"stop_token_ids": [2**31]}]),
        400,
        "sampling_params_list[0].stop_token_ids[0]",
    ),
    (
        "talker_frames_2^32",
        _raw(sampling_params_list=[{}, {"max_tokens": 2**32}]),
        400,
        "sampling_params_list[1].max_tokens",
    ),
    (
        "talker_seed_2^64",
        _raw(sampling_params_list=[{}, {"seed": 2**64}]),
        400,
        "sampling_params_list[1].seed",
    ),
    ("stage_top_k_2^31", _raw(sampling_params_list=[{"top_k": 2**31}]), 400, "sampling_params_list[0].top_k"),
    # non-finite numbers, as literals, as overflowing decimals, as integers too large for a double
    ("temperature_NaN", _raw(temperature=0.5).replace(b"0.5", b"NaN"), 400, "temperature"),
    ("top_p_Infinity", _raw(top_p=0.5).replace(b"0.5", b"Infinity"), 400, "top_p"),
    ("temperature_-Infinity", _raw(temperature=0.5).replace(b"0.5", b"-Infinity"), 400, "temperature"),
    ("temperature_1e400", _raw(temperature=0.5).replace(b"0.5", b"1e400"), 400, "temperature"),
    ("temperature_int_overflow", _raw(temperature=10**400), 400, "temperature"),
    (
        "stage_temperature_NaN",
        _raw(sampling_params_list=[{"temperature": 0.5}]).replace(b"0.5", b"NaN"),
        400,
        "sampling_params_list[0].temperature",
    ),
    (
        "stage_penalty_over_float32",
        _raw(sampling_params_list=[{"repetition_penalty": 1e39}]),
        400,
        "sampling_params_list[0].repetition_penalty",
    ),
    (
        "talker_temperature_1e400",
        _raw(sampling_params_list=[{}, {"temperature": 0.5}]).replace(b"0.5", b"1e400"),
        400,
        "sampling_params_list[1].temperature",
    ),
    (
        "nan_in_media_part",
        _raw(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "w": 0.5}]}]).replace(
            b"0.5", b"NaN"
        ),
        400,
        "messages[0].content[0].w",
    ),
    # token budgets beyond the whole thinker context (OpenAI refuses these too)
    ("max_tokens_1e9", _raw(max_tokens=10**9), 400, "max_tokens"),
    ("max_completion_tokens_over_context", _raw(max_completion_tokens=MAX_MODEL_LEN + 1), 400, "max_tokens"),
    (
        "stage_max_tokens_over_context",
        _raw(sampling_params_list=[{"max_tokens": MAX_MODEL_LEN * 10}]),
        400,
        "max_tokens",
    ),
    ("min_tokens_over_context", _raw(min_tokens=MAX_MODEL_LEN + 1), 400, "min_tokens"),
    # media whose decoder error embeds a Python object repr
    (
        "garbage_image_data_url",
        _raw(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": data_url(b"definitely not an image", "image/png")},
                        }
                    ],
                }
            ]
        ),
        400,
        "messages[0].content[0]",
    ),
    (
        "truncated_png",
        _raw(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(png_bytes()[:40], "image/png")}}
                    ],
                }
            ]
        ),
        400,
        "messages[0].content[0]",
    ),
    # a decompression bomb: ~100 kB declaring 30000x30000 pixels, refused from its header
    (
        "bomb_png",
        _raw(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "describe"},
                        {"type": "image_url", "image_url": {"url": data_url(bomb_png(), "image/png")}},
                    ],
                }
            ]
        ),
        413,
        "messages[0].content[1]",
    ),
    ("not_json", b'{"model": ', 400, None),
    ("not_utf8", b'{"model": "\xff\xfe"}', 400, None),
]


@pytest.mark.parametrize("name, body, status, param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_body_is_4xx_with_reason_and_keeps_the_connection(
    conn: http.client.HTTPConnection, name: str, body: bytes, status: int, param: str | None
) -> None:
    got, data = _post(conn, body)
    assert got == status, (name, data)
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}
    # the reason the client must fix (invalid_value, image_too_large, ...), never the bare status
    assert isinstance(err["code"], str) and err["code"], err
    assert err["type"] == "invalid_request_error", err
    assert err["message"] and not _REPR.search(err["message"]), err["message"]
    if param is not None:
        assert err["param"] == param, err
    _assert_still_usable(conn)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "application/xml"],
)
def test_non_json_content_type_is_415(conn: http.client.HTTPConnection, content_type: str) -> None:
    got, data = _post(conn, _raw(), content_type)
    assert got == 415 and data["error"]["code"] == 415 and "application/json" in data["error"]["message"]
    _assert_still_usable(conn)


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "APPLICATION/JSON", "application/vnd.api+json", None]
)
def test_json_content_types_pass_to_validation(
    conn: http.client.HTTPConnection, content_type: str | None
) -> None:
    """Accepted types reach field validation: an invalid role is then the 400 that comes back."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}).encode()
    got, data = _post(conn, body, content_type)
    assert got == 400 and data["error"]["param"] == "messages[0].role"


def test_openapi_declares_the_chat_body(gateway: ThreadedGateway, conn: http.client.HTTPConnection) -> None:
    conn.request("GET", "/openapi.json")
    resp = conn.getresponse()
    spec = json.loads(resp.read())
    body = spec["paths"][ROUTE]["post"]["requestBody"]
    assert body["required"] is True
    ref = body["content"]["application/json"]["schema"]["$ref"]
    schemas = spec["components"]["schemas"]
    chat = schemas[ref.rsplit("/", 1)[-1]]
    assert "messages" in chat["required"] and chat["properties"]["messages"]["minItems"] == 1
    assert chat["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 2**32 - 1
    # the OpenAI fields the validation layer parses are declared (schemathesis generates from these)
    for name in (
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "stop",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "max_completion_tokens",
        "audio",
    ):
        assert name in chat["properties"], name
    assert chat["properties"]["top_logprobs"]["anyOf"][0]["maximum"] == 20
    # messages: one schema per role (the validating models' discriminated union)
    roles = {
        schemas[m["$ref"].rsplit("/", 1)[-1]]["properties"]["role"]["const"]
        for m in chat["properties"]["messages"]["items"]["oneOf"]
    }
    assert roles == {"system", "developer", "user", "assistant", "tool"}
    assert "tool_call_id" in schemas["ToolMessage"]["required"]
    assert "schema" in schemas["JSONSchemaSpec"]["properties"]
    # sampling_params_list: the thinker's keys at position 0, the talker's at 1
    spl = chat["properties"]["sampling_params_list"]["anyOf"][0]["prefixItems"]
    assert spl[1]["anyOf"][0]["$ref"].endswith("/TalkerSampling")
    assert "max_new_frames" in schemas["TalkerSampling"]["properties"]
    # every $ref in the document resolves
    for target in re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec)):
        assert target in schemas, target


def test_no_request_content_or_secrets_in_logs(caplog: pytest.LogCaptureFixture) -> None:
    """At the default level (INFO) nothing a client sent - text, media, keys - reaches the gateway's logs,
    whatever the outcome (401, 400, 503 with stages down)."""
    secret_text, secret_key = "SECRET-PROMPT-4711", "sk-SECRET-KEY-0815"
    addrs = {s: dead_address() for s in ("thinker", "talker", "code2wav")}
    config = GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu"), api_key="right-key")
    caplog.set_level("INFO")
    with ThreadedGateway(config) as gw:
        c = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
        body = json.dumps(_body(messages=[{"role": "user", "content": secret_text}])).encode()
        for key in (secret_key, "right-key"):
            for payload in (body, body.replace(b'"user"', b'"robot"'), body[:-3]):
                c.request(
                    "POST",
                    ROUTE,
                    body=payload,
                    headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
                )
                resp = c.getresponse()
                resp.read()
                assert resp.status in (400, 401, 503), resp.status
        c.close()
    assert caplog.records, "the gateway logged nothing at all: the check would be vacuous"
    assert secret_text not in caplog.text and secret_key not in caplog.text


# The numeric fields of the body: NaN / Infinity / -Infinity in each is a 400 naming that field.
NUMERIC_FIELDS = [
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "top_k",
    "min_tokens",
    "top_logprobs",
]


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
@pytest.mark.parametrize("field", NUMERIC_FIELDS)
def test_non_finite_number_names_the_field(
    conn: http.client.HTTPConnection, field: str, token: bytes
) -> None:
    body = _raw(**{field: 12345}).replace(b"12345", token)
    got, data = _post(conn, body)
    err = data["error"]
    assert got == 400 and err["param"] == field and err["code"] == "invalid_value", data
    assert err["type"] == "invalid_request_error"
    _assert_still_usable(conn)


def test_bomb_png_then_a_request_on_the_same_connection(gateway: ThreadedGateway) -> None:
    """The bomb is a 413 naming the limit, and the same kept-alive httpx connection serves the next request."""
    import httpx

    body = _body(
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": data_url(bomb_png(), "image/png")}}],
            }
        ]
    )
    sockets: list[object] = []
    with httpx.Client(base_url=gateway.url, timeout=30, limits=httpx.Limits(max_connections=1)) as client:

        def note(response: httpx.Response) -> None:
            sockets.append(response.extensions["network_stream"].get_extra_info("socket"))

        client.event_hooks["response"] = [note]
        r = client.post(ROUTE, json=body)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "image_too_large" and err["param"] == "messages[0].content[0]"
        assert "pixels" in err["message"] and r.headers.get("connection") != "close"
        follow = client.get("/v1/models")
        assert follow.status_code == 200
    assert len(sockets) == 2 and sockets[0] is sockets[1], "the follow-up request needed a new connection"


def _count(status: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value("minicpmo_gateway_requests_total", {"route": ROUTE, "status": status})
    return value or 0.0


def test_truncated_bodies_count_as_client_aborts(
    gateway: ThreadedGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Content-Length larger than what arrives, then close: a 499 in the request metrics, no 5xx, no traceback."""
    import socket
    import time

    before_499, before_500 = _count("499"), _count("500")
    n = 5
    for i in range(n):
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
            head = (
                f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: 100000\r\n\r\n"
            ).encode()
            sock.sendall(head + _raw()[:20])
            if i % 2:  # half closed, half reset
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    deadline = time.monotonic() + 10
    while _count("499") < before_499 + n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _count("499") == before_499 + n
    assert _count("500") == before_500
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize(
    ("route", "content_type", "first_bytes"),
    [
        (ROUTE, "application/json", b'{"model": "'),
        ("/v1/audio/transcriptions", "multipart/form-data; boundary=xx", b"--xx\r\n"),
    ],
)
def test_a_stalled_body_is_answered_408_and_its_connection_closed(
    route: str, content_type: str, first_bytes: bytes
) -> None:
    """A client that stops sending mid-body (or trickles bytes to hold a socket) gets 408
    ``request_timeout`` once the body has been idle for gateway.body_idle_timeout_s, and the connection
    is closed (the rest of the body may still arrive); a slow but steady body is read to its end."""
    addrs = {s: dead_address() for s in ("thinker", "talker", "code2wav")}
    config = GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu"), body_idle_timeout_s=0.5)
    with ThreadedGateway(config) as gw:
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
        conn.putrequest("POST", route)
        conn.putheader("Content-Type", content_type)
        conn.putheader("Content-Length", "1000")
        conn.endheaders(first_bytes)
        resp = conn.getresponse()
        err = json.loads(resp.read())["error"]
        assert resp.status == 408 and err["code"] == "request_timeout", err
        assert resp.getheader("connection") == "close"
        conn.close()

        steady = _raw(messages=[])  # refused for its content (400), after being read whole
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
        conn.putrequest("POST", ROUTE)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(steady)))
        conn.endheaders()
        for i in range(0, len(steady), len(steady) // 4 + 1):
            time.sleep(0.3)  # each piece comes within the idle limit; the whole body takes longer
            conn.send(steady[i : i + len(steady) // 4 + 1])
        resp = conn.getresponse()
        assert resp.status == 400 and json.loads(resp.read())["error"]["param"] == "messages"
        conn.close()
