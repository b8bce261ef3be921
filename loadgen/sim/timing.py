"""The timing fields of the simulated worker's ``meta_info``: what SGLang 0.5.23 adds to each answer with
``--enable-metrics``, from the simulated schedule.

SGLang's sources (0.5.23, ``python/sglang/srt``): the scheduler's times
(``observability/req_time_stats.py``, ``SchedulerReqTimeStats.convert_to_output_meta_info``) go into every
output chunk once they are set; the tokenizer's (``APIServerReqTimeStats.convert_to_output_meta_info``)
into the last one; ``managers/tokenizer_manager.py`` adds ``num_retractions`` to every chunk,
``e2e_latency`` to the last and ``response_sent_to_client_ts`` to the first one a stream sends (and to the
last answer). The fields, s:

- every chunk: ``num_retractions`` (SGLang's ``Req.retraction_count``: :attr:`RequestTimes.retractions`);
  once admitted ``queue_time`` (the waits in the waiting queue, the first and each after a retraction:
  :attr:`RequestTimes.queue_s`) and ``forward_entry_time`` (the first forward, Unix time: the start of the
  step that admitted it); once prefilled ``prefill_finished_time`` (Unix time: the end of the step that
  gave its first token);
- the last chunk: ``request_received_ts`` (``/generate`` received), ``api_server_dispatch_finish_ts`` (the
  tokenizer done, the request in the scheduler's queue: the TTFT floor passed), ``request_finished_ts``
  (the last token's step end), all Unix times; ``first_token_latency`` (received to the first token's
  step end) and ``decode_throughput`` (``(completion_tokens - 1)`` over the first to the last token,
  tokens/s);
- ``response_sent_to_client_ts``: when a stream's first chunk went out (in it and in the last chunk), or
  the non-streamed answer (Unix time).

The simulator's clock is simulated seconds (:meth:`loadgen.sim.server.SimServer.now`): durations are
simulated seconds, like ``e2e_latency``, and a Unix time is the server's start time plus the simulated
seconds since. At ``--speed 1`` (the default) both are the wall clock's, so a gateway's per-request
breakdown (``service/observability/breakdown.py``) lines up with its own clock; at another speed they are
the modelled GPU's. The TTFT floor stands for SGLang's HTTP receipt, tokenizer and hand-off to the
scheduler, so all of it is the tokenizer's phase here.
"""

from __future__ import annotations

from typing import Any

from loadgen.sim.engine import RequestTimes


def _r(seconds: float) -> float:
    return round(seconds, 6)


def scheduler_meta(times: RequestTimes | None, epoch_s: float) -> dict[str, Any]:
    """The fields every chunk carries (see the module table): ``num_retractions`` always (0 without
    ``times``); ``queue_time``, ``forward_entry_time`` and ``prefill_finished_time`` once known.

    Args:
        times: the request's scheduler times (simulated s), None before its first event.
        epoch_s: the Unix time of simulated second 0, s.
    """
    if times is None:
        return {"num_retractions": 0}
    meta: dict[str, Any] = {"num_retractions": times.retractions}
    if times.forward_entry_s is not None:
        meta["forward_entry_time"] = _r(epoch_s + times.forward_entry_s)
        meta["queue_time"] = _r(times.queue_s)
    if times.prefill_finished_s is not None:
        meta["prefill_finished_time"] = _r(epoch_s + times.prefill_finished_s)
    return meta


def finished_meta(
    times: RequestTimes | None,
    received_s: float,
    first_token_s: float | None,
    end_s: float,
    completion_tokens: int,
    epoch_s: float,
) -> dict[str, Any]:
    """The tokenizer's fields of the last chunk (see the module table).

    Args:
        times: the request's scheduler times, None if it never produced a token.
        received_s: when ``/generate`` received it, simulated s.
        first_token_s: its first token's step end, simulated s (None: no token).
        end_s: its last token's step end (or the abort), simulated s.
        completion_tokens: tokens generated.
        epoch_s: the Unix time of simulated second 0, s.
    """
    meta: dict[str, Any] = {
        "request_received_ts": _r(epoch_s + received_s),
        "request_finished_ts": _r(epoch_s + end_s),
    }
    if times is not None:
        meta["api_server_dispatch_finish_ts"] = _r(epoch_s + times.ready_s)
    if first_token_s is not None and first_token_s > received_s:
        meta["first_token_latency"] = _r(first_token_s - received_s)
        decode_s = end_s - first_token_s
        if completion_tokens > 1 and decode_s > 0:
            meta["decode_throughput"] = round((completion_tokens - 1) / decode_s, 3)
    return meta


def sent_meta(sent_s: float, epoch_s: float) -> dict[str, Any]:
    """``response_sent_to_client_ts``: the Unix time for simulated second ``sent_s``."""
    return {"response_sent_to_client_ts": _r(epoch_s + sent_s)}


__all__ = ["finished_meta", "scheduler_meta", "sent_meta"]
