"""What one model's admission sees of its demand, for the planner (pure): counted by the gateway's scheduler
(:mod:`service.pipeline.scheduler`) and by the fleet simulation (:mod:`loadgen.fleet.sim`), read by
:mod:`policies.planner_inputs`.

:class:`DemandMeter` counts, per class (band), every request that reached admission -- admitted, queued
or shed alike: a shed request is demand the workers did not serve -- with its prompt and output lengths,
and the prompt tokens the engines answered from their prefix cache. The planner takes the counts once an
interval (:meth:`DemandMeter.take`) and turns them into rates. Output length is the request's
``max_tokens`` (what admission knows at arrival): the planner uses lengths only relative to their mean
(:meth:`policies.planner.EngineModel.from_capacity`), so the bias of a cap over the real length cancels
while the classes' caps keep their proportions.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BandCounts:
    """One class's arrivals over an interval.

    Attributes:
        requests: arrivals.
        prompt_tokens: their prompt tokens, summed.
        output_tokens: their ``max_tokens``, summed.
    """

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(slots=True)
class DemandCounts:
    """What :meth:`DemandMeter.take` hands over: per band its counts, and the cache's share.

    Attributes:
        bands: band -> its arrivals.
        prompt_tokens: prompt tokens of the requests answered in the interval (engine counts).
        cached_tokens: of those, the tokens served from a prefix cache.
    """

    bands: dict[str, BandCounts] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def cache_hit_rate(self) -> float | None:
        """Cached over prompt tokens (None when nothing was answered)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens > 0 else None


class DemandMeter:
    """Counts a model's arrivals and cache hits until :meth:`take` (one per scheduler)."""

    def __init__(self) -> None:
        self._counts = DemandCounts()

    def arrive(self, band: str, prompt_tokens: int, max_tokens: int) -> None:
        """A request reached admission."""
        counts = self._counts.bands.get(band)
        if counts is None:
            counts = self._counts.bands[band] = BandCounts()
        counts.requests += 1
        counts.prompt_tokens += prompt_tokens
        counts.output_tokens += max_tokens

    def answered(self, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """A request was answered with the engine's counts (unknown counts are skipped)."""
        if prompt_tokens and cached_tokens is not None:
            self._counts.prompt_tokens += prompt_tokens
            self._counts.cached_tokens += min(prompt_tokens, cached_tokens)

    def take(self) -> DemandCounts:
        """The counts since the last call, and start again."""
        counts, self._counts = self._counts, DemandCounts()
        return counts


__all__ = ["BandCounts", "DemandCounts", "DemandMeter"]
