"""What a worker's answer is made of, as the gateway reads it: one chunk of a stream (or the whole answer).

Its own module so that the client (:mod:`service.workers.client`), the errors that carry a partial answer
(:mod:`service.workers.upstream_errors`) and the pipeline all name it without importing one another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

WorkerLogprob = tuple[float, int, tuple[tuple[float, int], ...]]
"""One generated token's log probability as a worker reports it: (logprob, token id, the top alternatives
as (logprob, token id), most likely first)."""


@dataclass(frozen=True, slots=True)
class UpstreamChunk:
    """One step of a worker's answer (or the whole answer, when not streamed).

    Attributes:
        text: new text since the previous chunk (the full text for a non-streamed answer).
        prompt_tokens, completion_tokens, cached_tokens: the worker's counts so far (tokens).
        finish_reason: ``"stop"``, ``"length"``, or None while generating.
        output_ids: the token ids new in this chunk (all of them for a non-streamed answer), if sent.
        logprobs: the log probabilities of the tokens new in this chunk, when asked for
            (``return_logprob``); None otherwise.
        more_ready: another chunk of this stream came in the same read and follows at once (no wait),
            so its events may go to the client in one write with this one's.
        meta: the worker's ``meta_info`` of this chunk, as sent (its timing fields feed the request's
            breakdown, :mod:`service.observability.breakdown`); None when it sent none.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None
    output_ids: tuple[int, ...] | None = None
    logprobs: tuple[WorkerLogprob, ...] | None = None
    more_ready: bool = False
    meta: Mapping[str, Any] | None = None
