"""Checks of the response invariants (docs/protocol.md: R1–R12, parts of B2/B3) over a recorded event list.

Used by the lifecycle unit tests and by the end-to-end tests against real stage servers, so both hold the
server to the same statements.
"""

from __future__ import annotations

import base64
from collections import defaultdict
from typing import Any

from realtime_helpers import EVENT_ID_RE, response_metadata

TERMINAL_ORDER = [
    "response.output_audio.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]


def _rid(event: dict[str, Any]) -> str | None:
    if "response_id" in event:
        return event["response_id"]
    if event["type"] in ("conversation.item.added", "conversation.item.created", "conversation.item.done"):
        item_id = event.get("item", {}).get("id", "")
        if item_id.startswith("item_resp_"):
            return item_id[len("item_") :]
    return None


def _is_call_event(event: dict[str, Any]) -> bool:
    """An event of a function call output item (its own item, next to the response's message item)."""
    if event["type"].startswith("response.function_call_arguments."):
        return True
    item = event.get("item")
    return isinstance(item, dict) and item.get("type") == "function_call"


def _check_calls(
    rid: str, evs: list[tuple[int, dict[str, Any]]], done: dict[str, Any]
) -> list[dict[str, Any]]:
    """Each function call item of a response: added → argument deltas → arguments done → item done, the
    deltas adding up to the arguments, and the item in ``response.done``'s output at its index."""
    calls: list[dict[str, Any]] = []
    output = done["response"]["output"]
    for _, added in evs:
        if added["type"] != "response.output_item.added" or added["item"]["type"] != "function_call":
            continue
        item_id, index = added["item"]["id"], added["output_index"]
        mine = [
            e for _, e in evs if e.get("item_id") == item_id or (e.get("item") or {}).get("id") == item_id
        ]
        types = [e["type"] for e in mine]
        assert types[0] == "response.output_item.added" and types[-1] == "response.output_item.done", types
        assert set(types[1:-1]) <= {
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
        }
        assert types[-2] == "response.function_call_arguments.done", types
        args_done = mine[-2]
        deltas = "".join(e["delta"] for e in mine if e["type"] == "response.function_call_arguments.delta")
        final = mine[-1]["item"]
        assert deltas == args_done["arguments"] == final["arguments"], (deltas, args_done, final)
        assert added["item"]["arguments"] == "" and added["item"]["call_id"] == args_done["call_id"]
        assert final["call_id"] == args_done["call_id"] and final["name"] == args_done["name"]
        assert all(e["output_index"] == index for e in mine), mine
        assert output[index] == final, (output, final)
        calls.append(final)
    return calls


def check_response_invariants(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Assert R1–R12 (and W10 for every event) over ``events`` in arrival order; returns a per-response summary.

    A response's function calls are items of their own (checked by :func:`_check_calls`); R1–R12 hold for
    its message item, which a response that only called a function does not have.
    """
    for event in events:
        assert isinstance(event.get("type"), str) and EVENT_ID_RE.match(event.get("event_id", "")), (
            event
        )  # W10
    by_rid: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for i, event in enumerate(events):
        rid = _rid(event)
        if rid is not None and event["type"] != "response.listen":
            by_rid[rid].append((i, event))
    summary: dict[str, dict[str, Any]] = {}
    seen_ids: set[str] = set()
    for rid, all_evs in by_rid.items():
        evs = [(i, e) for i, e in all_evs if not _is_call_event(e)]
        types = [e["type"] for _, e in evs]
        # R1: exactly one created, first
        assert types.count("response.created") == 1, (rid, types)
        assert types[0] == "response.created", (rid, types)
        assert rid not in seen_ids  # R11
        seen_ids.add(rid)
        created = evs[0][1]
        epoch = response_metadata(created)["epoch"]
        # R7: exactly one done, last (rate_limits.updated has no response id)
        assert types.count("response.done") == 1, (rid, types)
        assert types[-1] == "response.done", (rid, types[-5:])
        done = evs[-1][1]
        # R2: at most one speak, before the first audio delta
        if "response.speak" in types:
            assert types.count("response.speak") == 1
            first_audio = (
                types.index("response.output_audio.delta")
                if "response.output_audio.delta" in types
                else len(types)
            )
            assert types.index("response.speak") < first_audio
        # R3: each audio delta immediately followed (within the response) by one transcript delta
        audio_n = types.count("response.output_audio.delta")
        for k, t in enumerate(types):
            if t == "response.output_audio.delta":
                assert types[k + 1] == "response.output_audio_transcript.delta", (rid, types[k : k + 3])
        transcript_deltas = [
            e["delta"] for _, e in evs if e["type"] == "response.output_audio_transcript.delta"
        ]
        text_only_deltas = [e for _, e in evs if e["type"] == "response.output_audio_transcript.delta"]
        assert len(text_only_deltas) >= audio_n
        if audio_n:
            assert len(transcript_deltas) == audio_n, (rid, audio_n, len(transcript_deltas))
        transcript = "".join(transcript_deltas)
        # A text-only response (session or per-response output_modalities) tells its text in output_text
        # events and its item holds an output_text part.
        text_only = "response.output_text.done" in types
        if text_only:
            transcript = "".join(e["delta"] for _, e in evs if e["type"] == "response.output_text.delta")
        # R4
        tdone = [e for _, e in evs if e["type"] == "response.output_audio_transcript.done"]
        if text_only:
            assert not tdone and not audio_n, (rid, types)
        elif transcript:
            assert len(tdone) == 1 and tdone[0]["transcript"] == transcript
        else:
            assert not tdone
        # R5, R8, R12
        last_ms = -1
        eot_seen = False
        audio_deltas = [e for _, e in evs if e["type"] == "response.output_audio.delta"]
        total_bytes = 0
        for e in audio_deltas:
            assert not eot_seen, f"{rid}: audio delta after end_of_turn"
            assert e["sample_rate_hz"] == 24000 and e["format"] == "pcm16"
            raw = base64.b64decode(e["delta"])
            assert len(raw) % 2 == 0
            total_bytes += len(raw)
            md = e["metadata"]
            assert md["audio_duration_ms"] >= last_ms
            last_ms = md["audio_duration_ms"]
            assert md["epoch"] == epoch  # R12
            eot_seen = md["end_of_turn"]
        status = done["response"]["status"]
        if status == "completed" and audio_deltas:
            assert audio_deltas[-1]["metadata"]["end_of_turn"] is True  # R8
        # R6 terminal order
        positions = [types.index(t) for t in TERMINAL_ORDER if t in types]
        assert positions == sorted(positions), (rid, types)
        if text_only:
            assert "response.output_text.done" in types and "response.output_audio.done" not in types
        elif audio_deltas or transcript or (status != "completed" and "response.content_part.added" in types):
            assert "response.output_audio.done" in types  # a response that only called has no message
        done_idx = evs[-1][0]
        assert (
            events[done_idx + 1]["type"] == "rate_limits.updated"
            and events[done_idx + 1]["rate_limits"] == []
        )
        calls = _check_calls(rid, all_evs, done)
        # R9: the message item (a response that only called a function has none, nor any message event)
        messages = [o for o in done["response"]["output"] if o["type"] == "message"]
        assert len(messages) + len(calls) == len(done["response"]["output"]), done
        if messages:
            (out,) = messages
            assert out["id"] == "item_" + rid
            assert out["content"][0]["text" if text_only else "transcript"] == transcript
        else:
            assert calls and "response.content_part.added" not in types, (rid, types)
        summary[rid] = {
            "status": status,
            "reason": (done["response"].get("status_details") or {}).get("reason"),
            "audio_deltas": len(audio_deltas),
            "audio_bytes": total_bytes,
            "transcript": transcript,
            "done_index": done_idx,
            "epoch": epoch,
            "done": done,
            "calls": calls,
        }
    # R7/R10: nothing for a response after its done; listen with response_id only for a live response
    for i, event in enumerate(events):
        rid = _rid(event)
        if rid in summary and event["type"] != "response.done":
            assert i < summary[rid]["done_index"], f"{event['type']} for {rid} after its response.done"
        if event["type"] == "response.listen" and "response_id" in event:
            lrid = event["response_id"]
            assert lrid in summary and i < summary[lrid]["done_index"]
    return summary
