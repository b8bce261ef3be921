"""Token logprobs in OpenAI's shapes (:mod:`service.openai.logprobs`), with a byte-level tokenizer whose
tokens may cut a UTF-8 character (as byte-level BPE does). The real engine is in ``test_engine_openai.py``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from service.openai.logprobs import (
    LOGPROB_FLOOR,
    IncrementalText,
    LogprobTrack,
    chat_logprobs,
    legacy_logprobs,
)

END = 0  # the end-of-turn special token


class ByteTokens:
    """Token ids 1..: one piece of bytes each (some are half a UTF-8 character); 0 is special."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = [b"", *pieces]

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.pieces[i] for i in ids if i != END).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return token_id == END

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]


E_ACUTE = "é".encode()  # two bytes
PIECES = [b"h", E_ACUTE[:1], E_ACUTE[1:], b"llo", b" w", "ö".encode(), b"rld", b"!"]
TEXT = "héllo wörld!"


def test_incremental_text_gives_each_token_the_characters_it_completes() -> None:
    text = IncrementalText(ByteTokens(PIECES))
    added = [text.push(i) for i in range(1, len(PIECES) + 1)]
    assert added == ["h", "", "é", "llo", " w", "ö", "rld", "!"]
    assert "".join(added) == TEXT
    assert text.push(END) == ""


def entries(ids: Sequence[int], top: int = 3) -> list[tuple[float, int, tuple[tuple[float, int], ...]]]:
    """Worker logprobs: chosen token ``i`` with logprob -i/10; alternatives: the chosen one, then others."""
    out = []
    for i in ids:
        alternatives = (
            (-i / 10, i),
            *((-(i + k) / 10 - 1, (i + k) % len(PIECES) + 1) for k in range(1, top)),
        )
        out.append((-i / 10, i, alternatives))
    return out


def test_tokens_join_to_the_text_and_carry_their_bytes_and_alternatives() -> None:
    track = LogprobTrack(ByteTokens(PIECES), 2)
    ids = list(range(1, len(PIECES) + 1))
    got = track.push([*entries(ids), (-0.01, END, ())], len(TEXT), final=True)
    assert "".join(t.token for t in got) == TEXT
    assert [t.token for t in got] == ["h", "", "é", "llo", " w", "ö", "rld", "!"]
    assert [t.bytes for t in got] == PIECES  # the special end token is left out
    assert [t.logprob for t in got] == [-i / 10 for i in ids]
    assert all(len(t.top) == 2 for t in got)
    assert got[2].top[0].token == "é" and got[2].top[0].bytes == E_ACUTE[1:]  # chosen: its text in the answer


def test_streamed_pieces_release_tokens_only_once_their_text_arrived_and_drop_a_cut_stop() -> None:
    track = LogprobTrack(ByteTokens(PIECES), 0)
    first = track.push(entries([1, 2, 3]), len("hé"), final=False)
    assert [t.token for t in first] == ["h", "", "é"] and all(t.top == () for t in first)
    # the worker reports " w" and "ö" but a stop sequence " wö" cut them from the text
    rest = track.push(entries([4, 5, 6]), len("héllo"), final=True)
    assert [t.token for t in rest] == ["llo"]


def test_a_stop_sequence_matched_inside_a_token_keeps_the_token_s_shown_part() -> None:
    # stop "w" matched inside the token " w": the answer keeps its " " (a real worker: stop "the" inside
    # " the" left "... where " as content and "... where" as the joined tokens)
    track = LogprobTrack(ByteTokens(PIECES), 1)
    got = track.push(entries([1, 2, 3, 4, 5, 6]), len("héllo "), final=True)
    assert "".join(t.token for t in got) == "héllo "
    assert got[-1].token == " " and got[-1].bytes == b" w"  # bytes: the token's own, as always


def test_impossible_tokens_get_openais_floor() -> None:
    track = LogprobTrack(ByteTokens(PIECES), 1)
    (token,) = track.push([(-math.inf, 1, ((-math.inf, 1),))], 1, final=True)
    assert token.logprob == LOGPROB_FLOOR and token.top[0].logprob == LOGPROB_FLOOR


@pytest.mark.parametrize("top_n", [0, 1, 3])
def test_chat_and_legacy_shapes(top_n: int) -> None:
    track = LogprobTrack(ByteTokens(PIECES), top_n)
    tokens = track.push(entries([1, 4, 5], top=3), len("hllo w"), final=True)
    shape = chat_logprobs(tokens)
    assert shape["refusal"] is None
    assert [set(c) for c in shape["content"]] == [{"token", "logprob", "bytes", "top_logprobs"}] * 3
    assert shape["content"][1] == {
        "token": "llo",
        "logprob": -0.4,
        "bytes": list(b"llo"),
        "top_logprobs": [
            {"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in tokens[1].top
        ],
    }
    assert all(len(c["top_logprobs"]) == top_n for c in shape["content"])
    legacy = legacy_logprobs(tokens, 10)
    assert legacy["tokens"] == ["h", "llo", " w"] and legacy["token_logprobs"] == [-0.1, -0.4, -0.5]
    assert legacy["text_offset"] == [10, 11, 14]
    assert all(t in top for t, top in zip(legacy["tokens"], legacy["top_logprobs"], strict=True))
