"""The gateway's small routes and their bookkeeping, through the real app (no stage is contacted).

* ``GET /v1/models/{model}``: OpenAI's retrieve, as the stock SDK calls it (the served id's slash
  unescaped), and 404 ``model_not_found`` for another id;
* the refusals FastAPI validates itself (the audio routes' bodies) name the field as the chat body's do;
* ``minicpmo_gateway_requests_total`` counts by route template, so arbitrary paths cannot grow its
  label set.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from gateway_server import ThreadedGateway
from prometheus_client import REGISTRY
from stage_processes import dead_address

from gateway.config import GatewayConfig
from services.common.deploy_profile import load_profile

MODEL = "openbmb/MiniCPM-o-4_5"
KEY = "sk-routes-test"


@pytest.fixture(scope="module")
def gateway() -> Iterator[ThreadedGateway]:
    addrs = {s: dead_address() for s in ("thinker", "talker", "code2wav")}
    config = GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu"), api_key=KEY)
    with ThreadedGateway(config) as gw:
        yield gw


@pytest.fixture()
def client(gateway: ThreadedGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


def _count(route: str, status: str) -> float:
    labels = {"route": route, "status": status}
    return REGISTRY.get_sample_value("minicpmo_gateway_requests_total", labels) or 0.0


def test_retrieve_model_answers_the_served_id_and_404s_another(
    gateway: ThreadedGateway, client: httpx.Client
) -> None:
    listed = client.get("/v1/models").json()["data"][0]
    r = client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json() == listed
    r = client.get("/v1/models/gpt-4o")
    assert r.status_code == 404
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "`gpt-4o` does not exist" in err["message"] and MODEL in err["message"]
    assert httpx.get(f"{gateway.url}/v1/models/{MODEL}").status_code == 401  # the key is checked


def test_the_stock_sdk_retrieves_the_model(gateway: ThreadedGateway) -> None:
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-4o")


def test_fastapi_validated_bodies_name_the_field(client: httpx.Client) -> None:
    r = client.post("/v1/audio/speech", json={"model": MODEL, "voice": "alloy"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("input", "missing_required_parameter")
    assert err["message"] == "'input': is required"
    r = client.post("/v1/audio/speech", json={"model": MODEL, "input": "hi", "voice": "alloy", "speed": 9})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "speed" and err["message"].startswith("'speed': ")


def test_another_openai_endpoint_404s_with_what_is_served(client: httpx.Client) -> None:
    """A client written for another OpenAI endpoint learns which routes this server answers."""
    for method, path in (("POST", "/v1/responses"), ("POST", "/v1/completions"), ("GET", "/v1/nope")):
        r = client.request(method, path, json={"model": MODEL, "input": "hi"})
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == 404, r.text
        assert err["message"].startswith(f"{method} {path} is not a route of this server")
        assert "/v1/chat/completions" in err["message"] and "/v1/realtime" in err["message"]
    r = client.delete("/v1/audio/voices/nobody")  # a route's own 404 keeps its own message
    assert r.status_code == 404 and "is not a route" not in r.json()["error"]["message"]


def test_requests_are_counted_by_route_template(gateway: ThreadedGateway, client: httpx.Client) -> None:
    voices, unmatched = "/v1/audio/voices/{name}", "unmatched"
    before = (_count(voices, "404"), _count(unmatched, "404"), _count("unauthorized", "401"))
    for i in range(3):
        assert client.delete(f"/v1/audio/voices/nobody-{i}").status_code == 404
        assert client.get(f"/v1/no-such-route-{i}").status_code == 404
    assert httpx.get(f"{gateway.url}/v1/no-key-{MODEL}").status_code == 401  # refused before routing
    deadline = time.monotonic() + 10  # a request is counted once its answer is sent: poll for the last one
    while True:
        after = (_count(voices, "404"), _count(unmatched, "404"), _count("unauthorized", "401"))
        if [b - a for a, b in zip(before, after, strict=True)] == [3, 3, 1] or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert [b - a for a, b in zip(before, after, strict=True)] == [3, 3, 1]
    routes = {
        s.labels["route"]
        for m in REGISTRY.collect()
        if m.name == "minicpmo_gateway_requests"
        for s in m.samples
    }
    assert not any(tag in r for r in routes for tag in ("nobody-", "no-such-route-", "no-key-")), routes
