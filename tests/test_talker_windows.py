"""Codec window framing for Code2Wav: silence padding, left context, smaller first window, flushes."""

from __future__ import annotations

import pytest

from services.talker.windows import CodecWindower

SIL = 4218


def _all_windows(w: CodecWindower, chunks: list[list[int]]) -> list:
    out = []
    for c in chunks:
        out.extend(w.push(c))
    out.append(w.finish())
    return out


def test_upstream_framing_53_codes_in_25_25_3() -> None:
    codes = list(range(100, 153))
    wins = _all_windows(CodecWindower(), [codes[:25], codes[25:50], codes[50:]])
    assert [w.codes for w in wins] == [[SIL] * 3 + codes[0:25], codes[22:50], codes[47:53]]
    assert [w.left_context for w in wins] == [3, 3, 3]
    assert [w.is_last for w in wins] == [False, False, True]


def test_frames_arriving_one_by_one_give_the_same_windows() -> None:
    codes = list(range(60))
    one_by_one = _all_windows(CodecWindower(), [[c] for c in codes])
    at_once = _all_windows(CodecWindower(), [codes])
    assert [w.codes for w in one_by_one] == [w.codes for w in at_once]
    assert sum(w.new_frames for w in at_once) == 60


def test_boundary_end_sends_a_context_only_last_window() -> None:
    codes = list(range(50))
    wins = _all_windows(CodecWindower(), [codes])
    assert [w.is_last for w in wins] == [False, False, True]
    assert wins[-1].codes == codes[47:50] and wins[-1].new_frames == 0


def test_empty_stream_sends_only_silence_context() -> None:
    wins = _all_windows(CodecWindower(), [])
    assert len(wins) == 1 and wins[0].codes == [SIL] * 3 and wins[0].is_last


def test_smaller_first_window_cuts_time_to_first_audio() -> None:
    codes = list(range(40))
    w = CodecWindower(first_window_frames=10)
    first = w.push(codes[:10])
    assert len(first) == 1 and first[0].codes == [SIL] * 3 + codes[:10]
    rest = w.push(codes[10:])
    assert rest[0].codes == codes[7:35]  # then 25 new frames behind 3 of context
    last = w.finish()
    assert last.codes == codes[32:40] and last.is_last


def test_flush_partial_emits_only_with_enough_frames_and_keeps_context() -> None:
    w = CodecWindower()
    w.push([1, 2, 3, 4])
    assert w.flush_partial() == []  # fewer than 5 new frames
    w.push([5])
    (win,) = w.flush_partial()
    assert win.codes == [SIL] * 3 + [1, 2, 3, 4, 5] and not win.is_last
    assert w.push(list(range(10, 35)))[0].codes == [3, 4, 5, *range(10, 35)]


def test_finish_twice_is_an_error() -> None:
    w = CodecWindower()
    w.finish()
    with pytest.raises(RuntimeError):
        w.finish()
