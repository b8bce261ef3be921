"""``n`` > 1: the n choices of one request, run as n worker requests that share its queue slot.

Each choice is its own ``/generate`` request (rid ``<rid>-<i>``) through
:class:`service.pipeline.upstream.UpstreamCaller`, so each keeps what a single answer has: retries before its
first token, mid-stream resume on another worker, abort by rid. The request waits in the gateway's queue
once, for prompt + n x max_tokens (what its quota reservation holds), and its choices run on the worker
the scheduler picked.

The prompt is computed once: the first choice runs alone until its first token arrives (its prefill
then sits in the engine's radix cache), and the other n - 1 start after it and find the whole prompt
cached. SGLang's own ``n`` does the same with a separate prefill-only request
(``tokenizer_manager.py``, "Cache the common prefix for parallel sampling"); requests sent together would
each compute the prompt (measured on the CPU worker: 3 concurrent copies of a 781-token prompt each
reported 1 cached token).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence

from service.pipeline.prepare import PreparedRequest
from service.pipeline.upstream import Outcome, UpstreamCaller
from service.workers.chunks import UpstreamChunk

_Item = tuple[int, UpstreamChunk | None, Exception | None]


def choice_requests(prepared: PreparedRequest) -> list[PreparedRequest]:
    """The worker requests of each choice: the request itself when ``n`` is 1, else n copies with
    rids ``<rid>-<i>`` (and seeds ``seed + i``, wrapped in int64, when a seed is given)."""
    if prepared.n == 1:
        return [prepared]
    parts = []
    for i in range(prepared.n):
        rid = f"{prepared.rid}-{i}"
        sampling = dict(prepared.body["sampling_params"])
        if "sampling_seed" in sampling:  # one seed per choice, or all n answers would be the same
            sampling["sampling_seed"] = (sampling["sampling_seed"] + i + 2**63) % 2**64 - 2**63
        body = {**prepared.body, "rid": rid, "sampling_params": sampling}
        parts.append(dataclasses.replace(prepared, rid=rid, body=body, n=1))
    return parts


async def stream_choices(
    upstream: UpstreamCaller,
    prepared: PreparedRequest,
    parts: Sequence[PreparedRequest],
    outcomes: Sequence[Outcome],
) -> AsyncGenerator[tuple[int, UpstreamChunk], None]:
    """``(choice index, chunk)`` of all choices as they arrive (see the module docstring).

    Raises the first choice failure (a :class:`service.errors.GatewayError`); the other choices are then
    cancelled (the caller aborts them upstream). Closing the iterator cancels them too.
    """
    slot = await upstream.acquire(prepared)
    for outcome in outcomes:
        outcome.slot = slot
    queue: asyncio.Queue[_Item] = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []

    async def pump(i: int) -> None:
        try:
            async for chunk in upstream.stream(parts[i], outcomes[i]):
                queue.put_nowait((i, chunk, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))
        else:
            queue.put_nowait((i, None, None))

    def start(i: int) -> None:
        tasks.append(asyncio.create_task(pump(i), name=f"choice-{parts[i].rid}"))

    start(0)
    running = 1
    try:
        while running:
            i, chunk, error = await queue.get()
            if error is not None:
                raise error
            if len(tasks) == 1:  # the first choice's prompt is cached now (or it ended): start the rest
                for j in range(1, len(parts)):
                    start(j)
                running += len(parts) - 1
            if chunk is None:
                running -= 1
                continue
            yield i, chunk
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def merge_choices(total: Outcome, choices: Sequence[Outcome]) -> None:
    """Fill the request's outcome from its choices': the prompt and its cached tokens once (as the first
    choice reported them), completion tokens summed, finished when all finished."""
    if len(choices) == 1 and choices[0] is total:
        return
    first = choices[0]
    total.slot = first.slot
    total.worker = first.worker
    total.attempts = sum(c.attempts for c in choices)
    total.resumes = sum(c.resumes for c in choices)
    total.moves = sum(c.moves for c in choices)
    total.prompt_tokens = first.prompt_tokens or max(c.prompt_tokens for c in choices)
    total.cached_tokens = first.cached_tokens
    total.completion_tokens = sum(c.completion_tokens for c in choices)
    total.finished = all(c.finished for c in choices)
    total.streamed_any = any(c.streamed_any for c in choices)
    total.dispatched = any(c.dispatched for c in choices)
    total.resume_mode = next((c.resume_mode for c in choices if c.resume_mode), None)
    total.error_code = total.error_code or next((c.error_code for c in choices if c.error_code), None)


__all__ = ["choice_requests", "merge_choices", "stream_choices"]
