"""A faster :class:`~loadgen.sim.engine.SimEngine` for the fleet: same schedule, fewer objects per token.

The fleet needs only a request's first and last token; the HTTP simulator needs every token's text.
:class:`FleetEngine` overrides only ``SimEngine._emit`` (one call per generated token):

- output token ids come from a multiplicative hash of the prompt digest and the index instead of BLAKE2b
  (equal prompts still give equal outputs, so the prefix cache behaves the same: a later prompt can only
  extend an earlier *prompt*, never its unknown answer, in planned scenarios);
- tokens that are neither the first nor the last are reported as one shared event object
  (:attr:`FleetEngine.quiet`) instead of a new :class:`~loadgen.sim.engine.SimEvent` each.

Scheduling, step times, KV accounting, preemption and the prefix cache are the base class's, untouched;
``tests/loadgen/test_fleet_sim.py`` checks that both engines give identical first-token and finish times.
About 2.5x faster per generated token (measured in the fleet benchmark).
"""

from __future__ import annotations

from loadgen.sim.engine import FinishReason, SimEngine, SimEvent, _Req
from loadgen.sim.profiles import SimProfile

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio (Knuth's multiplicative hashing)
_MASK31 = 0x7FFFFFFF


class FleetEngine(SimEngine):
    """:class:`SimEngine` reporting only first and last tokens as their own events (see the module doc).

    Args:
        profile: step-time and capacity parameters.
        seed: seeds the step jitter (same meaning as the base class).
    """

    def __init__(self, profile: SimProfile, seed: int = 0) -> None:
        super().__init__(profile, seed)
        self.quiet = SimEvent(0.0, "", 0, 0, 0, 0, None)

    def _emit(self, r: _Req) -> SimEvent:
        outputs = r.outputs
        n = len(outputs) + 1
        outputs.append((((r.key ^ n) * _GOLDEN) >> 33 & _MASK31) or 1)
        req = r.req
        reason: FinishReason | None = None
        if req.stop_at is not None and n >= req.stop_at:
            reason = "stop"
        elif n >= req.max_new_tokens:
            reason = "length"
        if reason is not None:
            self._finish(r)
        elif n > 1:
            return self.quiet
        return SimEvent(self._now, req.rid, outputs[-1], n, len(req.prompt), r.cached or 0, reason)
