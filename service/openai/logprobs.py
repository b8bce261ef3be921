"""Token log probabilities in OpenAI's shapes, from SGLang's ``return_logprob`` / ``top_logprobs_num``.

SGLang reports each generated token as ``[logprob, token_id, text]`` and, when asked, its top
alternatives (``meta_info.output_token_logprobs`` / ``output_top_logprobs``;
:func:`service.workers.answers.worker_logprobs`). The gateway gives each chosen token the text it adds to
the answer, detokenized incrementally with the model's tokenizer the way SGLang's detokenizer does it
(vLLM's ``detokenize_incrementally``: decode a few tokens of context and keep the new characters; a token
that ends inside a UTF-8 character adds nothing until the character completes). So the chosen tokens
join to exactly the answer's text, streamed or not; ``bytes`` always holds the token's own bytes.

Tokens the answer does not show are left out: special tokens (end of turn) and the tokens of a matched
stop sequence, which SGLang reports but cuts from the text (:class:`LogprobTrack` lets a token through
only once the text it adds has arrived).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from service.workers.chunks import WorkerLogprob

LOGPROB_FLOOR = -9999.0
"""What ``-inf`` (a token the sampler could not pick) is reported as: OpenAI's own floor."""

CONTEXT_TOKENS = 5
"""Tokens of context decoded before a new one (vLLM's and SGLang's incremental detokenizers use 5)."""


class Tokens(Protocol):
    """What the logprobs need of a tokenizer (:class:`service.pipeline.prompting.PromptRenderer` has it)."""

    def decode(self, ids: Sequence[int]) -> str: ...

    def is_special(self, token_id: int) -> bool: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


@dataclass(frozen=True, slots=True)
class Alternative:
    """One of the most likely tokens at a position: its text, log probability and bytes."""

    token: str
    logprob: float
    bytes: bytes

    def openai(self) -> dict[str, Any]:
        """``{"token", "logprob", "bytes"}`` (chat's ``top_logprobs`` entries)."""
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes)}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A chosen token: the text it adds to the answer, its log probability, bytes and alternatives."""

    token: str
    logprob: float
    bytes: bytes
    top: tuple[Alternative, ...] = ()

    def chat(self) -> dict[str, Any]:
        """OpenAI's chat shape: ``{"token", "logprob", "bytes", "top_logprobs": [...]}``."""
        return {
            "token": self.token,
            "logprob": self.logprob,
            "bytes": list(self.bytes),
            "top_logprobs": [a.openai() for a in self.top],
        }


class IncrementalText:
    """The text each new token adds to an answer (see the module docstring).

    Args:
        tokens: the model's tokenizer.
    """

    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoded context
        self._read = 0  # tokens whose text was handed out

    def push(self, token_id: int) -> str:
        """The characters ``token_id`` completes ("" while a character is cut, or a special token)."""
        if self._tokens.is_special(token_id):
            return ""
        self._ids.append(token_id)
        before = self._tokens.decode(self._ids[self._prefix : self._read])
        after = self._tokens.decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix = max(0, len(self._ids) - CONTEXT_TOKENS)
        self._read = len(self._ids)
        return after[len(before) :]


@dataclass(slots=True)
class LogprobTrack:
    """Turns one choice's worker logprobs into :class:`TokenLogprob`, in step with the answer's text.

    Args:
        tokens: the model's tokenizer.
        top_n: alternatives per token to report (0-20).
    """

    tokens: Tokens
    top_n: int
    _text: IncrementalText = field(init=False)
    _held: list[TokenLogprob] = field(default_factory=list)
    _chars: int = 0  # characters of the answer the released tokens cover

    def __post_init__(self) -> None:
        self._text = IncrementalText(self.tokens)

    def _alternative(self, logprob: float, token_id: int, chosen: int, chosen_text: str) -> Alternative:
        raw = self.tokens.token_bytes(token_id)
        text = chosen_text if token_id == chosen else raw.decode("utf-8", errors="replace")
        return Alternative(text, _finite(logprob), raw)

    def push(self, entries: Sequence[WorkerLogprob], text_chars: int, final: bool) -> list[TokenLogprob]:
        """Take the next tokens; return those whose text is within the first ``text_chars`` characters of
        the answer. ``final``: the answer ended, the tokens beyond its text are dropped."""
        for logprob, token_id, top in entries:
            if self.tokens.is_special(token_id):
                continue
            text = self._text.push(token_id)
            alternatives = tuple(self._alternative(lp, alt, token_id, text) for lp, alt in top[: self.top_n])
            self._held.append(
                TokenLogprob(text, _finite(logprob), self.tokens.token_bytes(token_id), alternatives)
            )
        released = []
        while self._held and self._chars + len(self._held[0].token) <= text_chars:
            token = self._held.pop(0)
            self._chars += len(token.token)
            released.append(token)
        if final:
            if self._held and self._chars < text_chars:
                # a stop sequence matched inside this token: the answer shows the part before it
                token = self._held[0]
                released.append(replace(token, token=token.token[: text_chars - self._chars]))
                self._chars = text_chars
            self._held.clear()
        return released


def legacy_logprobs(tokens: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's completions shape: ``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob, the
    chosen token included, as OpenAI does) and ``text_offset`` (characters into the answer, from
    ``offset``)."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [
            {a.token: a.logprob for a in (*t.top, Alternative(t.token, t.logprob, t.bytes))} for t in tokens
        ],
        "text_offset": offsets,
    }


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat shape: ``{"content": [...], "refusal": null}``."""
    return {"content": [t.chat() for t in tokens], "refusal": None}


__all__ = [
    "LOGPROB_FLOOR",
    "Alternative",
    "IncrementalText",
    "LogprobTrack",
    "TokenLogprob",
    "Tokens",
    "chat_logprobs",
    "legacy_logprobs",
]
