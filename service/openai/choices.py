"""One answer (choice) of a request, read piece by piece from a worker: content, tool calls, logprobs.

A non-streamed answer is read as one piece and a streamed one chunk by chunk, by the same code
(:class:`ChoiceState`), so both give the same content, calls and logprobs, and the content and calls in
the same order (:meth:`ChoiceState.parts`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from service.openai.logprobs import LogprobTrack, TokenLogprob, Tokens
from service.openai.tools import ToolPlan
from service.workers.chunks import UpstreamChunk


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """How a request's answers are read.

    Attributes:
        tools: the request's tool plan (chat), or None.
        logprobs: alternatives per token to report (0-20), or None when logprobs were not asked for.
    """

    tools: ToolPlan | None = None
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call of one answer: its position among the answer's calls, id, function and arguments."""

    index: int
    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}`` (a message's ``tool_calls``)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def delta(self) -> dict[str, Any]:
        """The streamed form: the same with its ``index`` (the whole call in one delta)."""
        return {"index": self.index, **self.openai()}


def call_id(rid: str, choice: int, index: int) -> str:
    """A tool call's id: ``call_`` + 24 hex digits derived from the request id (unique per request)."""
    return "call_" + hashlib.sha256(f"{rid}:{choice}:{index}".encode()).hexdigest()[:24]


@dataclass(slots=True)
class ChoiceStep:
    """What one piece of a worker's answer added to a choice.

    Attributes:
        index: the choice's index.
        text: new content (all of this piece's text runs, joined).
        calls: tool calls completed in this piece.
        parts: the same text runs and calls in the order the model wrote them (text written after a call
            in the same piece comes after it: the Responses API's output items follow this order).
        logprobs: new token logprobs (None when not asked for).
        text_offset: characters of the answer before this piece's tokens (completions' ``text_offset``).
        finish_reason: set on the last piece.
    """

    index: int
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    parts: list[str | ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    text_offset: int = 0
    finish_reason: str | None = None

    @property
    def empty(self) -> bool:
        """Nothing to tell the client."""
        return not (self.text or self.calls or self.logprobs or self.finish_reason)


class ChoiceState:
    """Everything one choice produced so far.

    Args:
        index: the choice's index.
        rid: the request id (tool call ids derive from it).
        output: what to read out of the answer.
        tokens: the tokenizer (needed when logprobs are asked for).
    """

    def __init__(self, index: int, rid: str, output: OutputSpec, tokens: Tokens | None) -> None:
        self.index = index
        self._rid = rid
        self._parser = output.tools.parser() if output.tools is not None else None
        # OpenAI's chat completions end an answer that called functions with "tool_calls" for tool_choice
        # auto and required, and with "stop" for a named function (issue 25; SGLang 0.5.23's own OpenAI
        # route says "tool_calls" for both, serving_chat.py)
        named = output.tools is not None and output.tools.forced is not None
        self._calls_finish = "stop" if named else "tool_calls"
        self._track = (
            LogprobTrack(tokens, output.logprobs)
            if output.logprobs is not None and tokens is not None
            else None
        )
        self.content = ""
        self.calls: list[ToolCall] = []
        self._parts: list[str | ToolCall] = []  # content pieces and calls, in the order written
        self.logprobs: list[TokenLogprob] | None = [] if self._track is not None else None
        self.finish_reason: str | None = None
        self.started = False  # a piece arrived (streams announce the role once)
        self._raw_chars = 0  # characters of the worker's text so far
        self._logprob_chars = 0

    def parts(self) -> list[str | ToolCall]:
        """The answer so far as text runs and tool calls in the order the model wrote them (adjacent
        pieces of text joined into one run): what the Responses API's output items follow."""
        out: list[str | ToolCall] = []
        run: list[str] = []
        for part in self._parts:
            if isinstance(part, str):
                run.append(part)
                continue
            if run:
                out.append("".join(run))
                run = []
            out.append(part)
        if run:
            out.append("".join(run))
        return out

    def _add_text(self, step: ChoiceStep, text: str) -> None:
        step.text += text
        step.parts.append(text)
        self.content += text
        self._parts.append(text)

    def step(self, chunk: UpstreamChunk) -> ChoiceStep:
        """Read the next piece (the whole answer when not streamed)."""
        self.started = True
        final = chunk.finish_reason is not None
        self._raw_chars += len(chunk.text)
        step = ChoiceStep(self.index, text_offset=self._logprob_chars)
        if self._parser is None:
            if chunk.text:
                self._add_text(step, chunk.text)
        else:
            parsed = self._parser.feed(chunk.text)
            if final:
                parsed.extend(self._parser.finish(cut=chunk.finish_reason == "length"))
            for part in parsed.parts:
                if isinstance(part, str):
                    self._add_text(step, part)
                    continue
                n = len(self.calls)
                made = ToolCall(n, call_id(self._rid, self.index, n), part.name, part.arguments)
                self.calls.append(made)
                self._parts.append(made)
                step.calls.append(made)
                step.parts.append(made)
        if self._track is not None and self.logprobs is not None:
            step.logprobs = self._track.push(chunk.logprobs or (), self._raw_chars, final)
            self.logprobs += step.logprobs
            self._logprob_chars += sum(len(t.token) for t in step.logprobs)
        if final:
            reason = chunk.finish_reason
            self.finish_reason = step.finish_reason = (
                self._calls_finish if self.calls and reason == "stop" else reason
            )
        return step


__all__ = ["ChoiceState", "ChoiceStep", "OutputSpec", "ToolCall", "call_id"]
