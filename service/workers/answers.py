"""Reading a worker's answer: SGLang's ``/generate`` JSON (one object, or SSE ``data: {...}`` lines) into
:class:`service.workers.chunks.UpstreamChunk` values: new text and token ids (cumulative or incremental
streams), log probabilities, the worker's token counts and OpenAI's finish reason.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from service.workers.chunks import UpstreamChunk, WorkerLogprob
from service.workers.upstream_errors import (
    MALFORMED_ANSWER,
    UpstreamError,
    abort_error,
    malformed_error,
    stream_error,
)


def worker_logprobs(meta: dict[str, Any]) -> tuple[WorkerLogprob, ...] | None:
    """``meta_info.output_token_logprobs`` (``[logprob, id, text]`` per token) joined with
    ``output_top_logprobs`` (a list of ``[logprob, id, text]`` per token, or None) as
    :data:`WorkerLogprob`; None when the worker sent none. A missing logprob (None) reads as -inf."""
    chosen = meta.get("output_token_logprobs")
    if not isinstance(chosen, list):
        return None
    tops = meta.get("output_top_logprobs")
    tops = tops if isinstance(tops, list) else []
    out = []
    for i, entry in enumerate(chosen):
        alternatives = tops[i] if i < len(tops) and isinstance(tops[i], list) else []
        top = tuple((_logprob(a[0]), int(a[1])) for a in alternatives if isinstance(a, list) and len(a) >= 2)
        out.append((_logprob(entry[0]), int(entry[1]), top))
    return tuple(out)


def _logprob(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else float("-inf")


def finish_reason_of(meta: dict[str, Any]) -> str | None:
    """Map SGLang's ``meta_info.finish_reason`` (``{"type": ...}`` or a string) to OpenAI's."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(str(kind), "stop")


class StreamDeltas:
    """Turns one streamed answer's chunks into deltas: the text and token ids new since the last chunk.

    SGLang 0.5.23 (``tokenizer_manager.py``, ``_handle_batch_output``): by default each chunk carries
    the cumulative ``text`` and ``output_ids``; with ``--incremental-streaming-output`` both are deltas
    (queued deltas are concatenated, never dropped). The mode comes from the worker
    (:attr:`WorkerInfo.incremental_streaming`). When the worker did not say, the token counts tell: a
    cumulative chunk holds ``meta_info.completion_tokens`` ids, an incremental one only the new ones
    (the first chunk reads the same either way). The text's shape is never used to decide.

    Args:
        incremental: the worker's mode, or None when unknown.
    """

    def __init__(self, incremental: bool | None) -> None:
        self._incremental = incremental
        self._text_chars = 0  # length of the cumulative text so far
        self._ids = 0  # token ids so far
        self._logprobs = 0  # token logprobs so far
        self._last_incremental = False  # the mode the last step read

    def _is_incremental(self, n_ids: int | None, completion_tokens: int) -> bool:
        if self._incremental is not None:
            return self._incremental
        if n_ids is None or not completion_tokens or not self._ids:
            return False
        return n_ids + self._ids == completion_tokens

    def step(self, payload: dict[str, Any]) -> tuple[str, tuple[int, ...] | None]:
        """The new text and new token ids (None when the chunk has no ``output_ids``) of one chunk.

        Only the new ids are converted: a cumulative chunk repeats every id so far, and converting them
        all on each chunk made a stream's cost quadratic in its length."""
        raw_ids = payload.get("output_ids")
        ids: list[Any] | None = raw_ids if isinstance(raw_ids, list) else None
        meta = payload.get("meta_info") or {}
        text = payload.get("text")
        n_ids = None if ids is None else len(ids)
        self._last_incremental = self._is_incremental(n_ids, int(meta.get("completion_tokens") or 0))
        if self._last_incremental:
            self._ids += n_ids or 0
            new = None if ids is None else tuple([int(i) for i in ids])
            return (text if isinstance(text, str) else ""), new
        delta = ""
        if isinstance(text, str):
            delta = text[self._text_chars :]
            self._text_chars = max(self._text_chars, len(text))
        new_ids = None
        if ids is not None:
            new_ids = tuple([int(i) for i in ids[self._ids :]])
            self._ids = max(self._ids, len(ids))
        return delta, new_ids

    def new_logprobs(self, payload: dict[str, Any]) -> tuple[WorkerLogprob, ...] | None:
        """The token logprobs new in the chunk :meth:`step` just read (same mode as its ids)."""
        entries = worker_logprobs(payload.get("meta_info") or {})
        if entries is None or self._last_incremental:
            return entries
        new = entries[self._logprobs :]
        self._logprobs = max(self._logprobs, len(entries))
        return new


def chunk_of(
    payload: dict[str, Any],
    text: str,
    output_ids: tuple[int, ...] | None,
    logprobs: tuple[WorkerLogprob, ...] | None = None,
    more_ready: bool = False,
) -> UpstreamChunk:
    meta = payload.get("meta_info") or {}
    return UpstreamChunk(
        text=text,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or 0),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        finish_reason=finish_reason_of(meta),
        output_ids=output_ids,
        logprobs=logprobs,
        more_ready=more_ready,
        meta=meta or None,
    )


def batch_chunks(
    worker: str, batch: list[bytes], deltas: StreamDeltas
) -> tuple[list[UpstreamChunk], UpstreamError | None, bool]:
    """The chunks of the SSE lines one read of ``worker``'s stream brought (``batch``), each but the last
    marked ``more_ready``; the error that ends the stream after them (an error event, a malformed or
    aborted chunk), if any; and whether ``data: [DONE]`` came. The last chunk before an error is not
    marked: the stream may then resume elsewhere, a wait its events must not be held over."""
    chunks: list[UpstreamChunk] = []
    failure: UpstreamError | None = None
    done = False
    for line in batch:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True  # the caller reads on to the end of the response: the connection is reused
            break
        try:
            payload = orjson.loads(data)
            if "error" in payload:
                failure = stream_error(worker, payload)
                break
            text, ids = deltas.step(payload)
            chunk = chunk_of(payload, text, ids, deltas.new_logprobs(payload), True)
        except MALFORMED_ANSWER as exc:
            failure = malformed_error(worker, exc)
            failure.__cause__ = exc
            break
        if chunk.finish_reason == "abort":
            failure = abort_error(worker, payload.get("meta_info") or {})
            break
        chunks.append(chunk)
    if chunks:
        chunks[-1] = replace(chunks[-1], more_ready=False)
    return chunks, failure, done


def joined(first: UpstreamChunk, then: UpstreamChunk) -> UpstreamChunk:
    """Two consecutive chunks of one stream as one: texts, token ids and log probabilities in order; the
    counts, finish and ``more_ready`` of the later (the worker's counts are cumulative). Token ids or log
    probabilities missing from either are missing from both (unknown)."""
    ids = None if first.output_ids is None or then.output_ids is None else first.output_ids + then.output_ids
    logprobs = None if first.logprobs is None or then.logprobs is None else first.logprobs + then.logprobs
    return replace(then, text=first.text + then.text, output_ids=ids, logprobs=logprobs)
