"""Load scenarios: pydantic models, a YAML/TOML loader, and the pure request planner.

A scenario says who sends (tenants with keys, priority class, fair-queuing weight and share of traffic), when
(an arrival process: Poisson, gamma-renewal with a coefficient of variation, and an optional piecewise rate
schedule), what (shared system prompts, user-turn and output lengths, streaming share, multi-turn sessions),
for how long (duration, warm-up, a request cap) and what counts as good (per-class TTFT/TPOT SLOs).

:func:`generate_requests` turns a scenario into the full list of :class:`PlannedRequest` (arrival times in
seconds from the start, tenant, class, messages, ``max_tokens``, stream flag, session). It is a pure function
of the scenario (its ``seed`` included): no clock, no I/O, no HTTP. The HTTP runner (``loadgen.runner``) and
the virtual-time fleet simulation (``loadgen.fleet``) both drive exactly this list.

Lengths are in *words*: the planner writes prompts as space-separated lower-case English words, so one word
is one token for the simulated worker's pseudo-tokenizer and the gateway's word-level test tokenizer
(``loadgen/sim/tokens.py``), and about 1-1.3 BPE tokens for a real model's tokenizer (common words are single
tokens in Llama-3 and SmolLM2 vocabularies). ``max_tokens`` is in the model's tokens.

Multi-turn sessions are planned open-loop: turn ``k`` quotes a *synthetic* assistant answer of the previous
turn's ``max_tokens`` words (the real answer is unknown when the plan is made), so a follow-up turn re-uses
the cached prefix up to the previous user turn, not the previous answer.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "at", "by", "from", "that", "this",
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school",
    "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week",
    "company", "system", "program", "question", "work", "government", "number", "night", "point", "home",
    "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book",
    "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend",
    "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name",
    "president", "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others",
    "level", "office", "door", "health", "person", "art", "war", "history", "party", "result", "change",
    "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education", "good",
    "new", "first", "last", "long", "great", "little", "own", "other", "old", "big", "high", "different",
    "small", "large", "next", "early", "young", "important", "few", "public", "bad", "same", "able", "river",
    "mountain", "garden", "music", "paper", "market", "light", "road", "table", "window", "picture", "energy",
)  # fmt: skip
"""Vocabulary of planned prompts: common English words (one token each in common BPE vocabularies)."""


class ScenarioError(ValueError):
    """A scenario file could not be read or did not validate; the message lists every problem."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LengthDist(_Model):
    """A distribution of a length (words, tokens or turns; the field using it says which).

    ``fixed``: always ``value``. ``uniform``: an integer in ``[low, high]``. ``lognormal``: mean ``mean`` and
    coefficient of variation ``cv`` (std / mean), rounded and clipped to ``[low, high]``. A bare integer in a
    scenario file means ``fixed``.
    """

    kind: Literal["fixed", "uniform", "lognormal"] = "fixed"
    value: int | None = Field(None, ge=0)
    mean: float | None = Field(None, gt=0)
    cv: float = Field(0.5, ge=0)
    low: int = Field(0, ge=0)
    high: int | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _bare_int(cls, data: Any) -> Any:
        return {"kind": "fixed", "value": data} if isinstance(data, int) else data

    @model_validator(mode="after")
    def _check(self) -> LengthDist:
        if self.kind == "fixed" and self.value is None:
            raise ValueError("a fixed length needs 'value'")
        if self.kind == "uniform" and self.high is None:
            raise ValueError("a uniform length needs 'low' and 'high'")
        if self.kind == "lognormal" and self.mean is None:
            raise ValueError("a lognormal length needs 'mean' (and optionally 'cv', 'low', 'high')")
        if self.high is not None and self.high < self.low:
            raise ValueError(f"'high' ({self.high}) is below 'low' ({self.low})")
        return self

    @property
    def expected(self) -> float:
        """The mean of the distribution before rounding and clipping."""
        if self.kind == "fixed":
            return float(self.value or 0)
        if self.kind == "uniform":
            return (self.low + (self.high or self.low)) / 2
        return float(self.mean or 0)

    def sample(self, rng: random.Random) -> int:
        """One draw, an integer."""
        if self.kind == "fixed":
            return int(self.value or 0)
        if self.kind == "uniform":
            return rng.randint(self.low, self.high or self.low)
        mean = float(self.mean or 1)
        sigma2 = math.log1p(self.cv**2)
        x = rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
        value = max(self.low, round(x))
        return min(value, self.high) if self.high is not None else value


class Tenant(_Model):
    """One tenant of the scenario.

    The API key is taken from ``api_key``, else from the environment variable ``api_key_env``, else from a
    keys file (``python -m loadgen tenants`` writes one). ``weight`` and ``quotas`` are what
    ``loadgen tenants`` creates the tenant with on a radixgate gateway (admin API ``POST /admin/tenants``).
    """

    id: str = Field(..., pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    priority_class: str = Field("standard", min_length=1, max_length=64)
    share: float = Field(1.0, gt=0, description="Relative share of the arrivals (normalized over tenants).")
    weight: float = Field(1.0, gt=0, le=1000, description="Fair-queuing weight inside its priority band.")
    api_key: str | None = None
    api_key_env: str | None = None
    quotas: dict[str, float] | None = Field(None, description="requests_per_min, tokens_per_min, ...")
    max_tokens_cap: int | None = Field(None, ge=1)


class ClassSLO(_Model):
    """Service-level objective of a priority class (for goodput): a request is good if it succeeded and met
    every objective that is set. ``ttft_ms``: time to first token, ms. ``tpot_ms``: mean time per output
    token after the first, ms. ``e2e_ms``: end-to-end latency, ms."""

    ttft_ms: float = Field(..., gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    e2e_ms: float | None = Field(None, gt=0)


class RateStep(_Model):
    """From ``at_s`` seconds after the start on, arrivals come at ``rate_rps`` requests/s."""

    at_s: float = Field(..., ge=0)
    rate_rps: float = Field(..., ge=0)


class Arrival(_Model):
    """The arrival process of requests (open loop: arrivals never wait for responses).

    ``poisson``: exponential gaps at ``rate_rps`` requests/s. ``gamma``: gamma-distributed gaps with the same
    mean and coefficient of variation ``cv`` (``cv`` > 1 is burstier than Poisson, < 1 smoother, 1 = Poisson).
    ``schedule`` (optional) makes the rate piecewise constant over time; it overrides ``rate_rps`` from its
    first step on. A time-varying rate is applied by time rescaling (the renewal process runs in units of
    expected arrivals, mapped through the cumulative rate), so ``cv`` keeps its meaning at every rate.
    With multi-turn sessions the rate counts every turn: sessions start at ``rate / mean turns``.
    """

    process: Literal["poisson", "gamma"] = "poisson"
    rate_rps: float = Field(1.0, ge=0)
    cv: float = Field(1.0, gt=0)
    schedule: list[RateStep] | None = None

    @field_validator("schedule")
    @classmethod
    def _sorted(cls, steps: list[RateStep] | None) -> list[RateStep] | None:
        if steps is not None:
            if not steps:
                raise ValueError("an empty schedule: leave it out or give at least one step")
            if any(b.at_s <= a.at_s for a, b in itertools.pairwise(steps)):
                raise ValueError("schedule steps must have strictly increasing 'at_s'")
        return steps

    def steps(self) -> list[RateStep]:
        """The rate as (start, rate) steps from 0 s on."""
        sched = list(self.schedule or [])
        if not sched or sched[0].at_s > 0:
            sched.insert(0, RateStep(at_s=0.0, rate_rps=self.rate_rps))
        return sched


class SystemPrompts(_Model):
    """Shared system prompts: ``count`` distinct prompts of ``length`` words, each used by
    ``users_per_prompt`` users (so a scenario has ``count × users_per_prompt`` users, each pinned to one
    prompt). With ``shared_across_tenants`` false, each tenant gets its own ``count`` prompts and users."""

    count: int = Field(4, ge=0)
    length: LengthDist = Field(default_factory=lambda: LengthDist(kind="fixed", value=200))
    users_per_prompt: int = Field(8, ge=1)
    shared_across_tenants: bool = True


class Sessions(_Model):
    """Multi-turn sessions: ``turns`` per session (1 = single-turn requests); the gap between a turn's arrival
    and the next turn's is exponential with mean ``think_time_s`` seconds."""

    turns: LengthDist = Field(default_factory=lambda: LengthDist(kind="fixed", value=1))
    think_time_s: float = Field(5.0, ge=0)


class PromptMix(_Model):
    """What each request carries. ``user_turn`` and system prompt lengths in words; ``output`` is
    ``max_tokens`` (model tokens); ``stream_ratio`` is the share of streamed requests (0..1); ``ignore_eos``
    asks the engine (SGLang extension, accepted by radixgate) to produce exactly ``max_tokens``."""

    system_prompts: SystemPrompts = Field(default_factory=SystemPrompts)
    user_turn: LengthDist = Field(default_factory=lambda: LengthDist(kind="uniform", low=20, high=80))
    output: LengthDist = Field(default_factory=lambda: LengthDist(kind="uniform", low=16, high=128))
    stream_ratio: float = Field(1.0, ge=0, le=1)
    ignore_eos: bool = True
    sessions: Sessions = Field(default_factory=Sessions)

    @field_validator("output")
    @classmethod
    def _positive_output(cls, dist: LengthDist) -> LengthDist:
        if dist.kind == "fixed" and not dist.value:
            raise ValueError("output length must be at least 1 token")
        return dist


class Target(_Model):
    """Where to send: any OpenAI-compatible server (``base_url`` without ``/v1``), the chat route, the model
    name, and a per-request timeout (s)."""

    base_url: str = "http://127.0.0.1:8000"
    model: str = "SmolLM2-135M-Instruct"
    path: str = "/v1/chat/completions"
    timeout_s: float = Field(300.0, gt=0)
    max_connections: int = Field(4096, ge=1)
    send_priority: bool = Field(False, description="Add the tenant's class as radixgate's 'priority' field.")


class Scenario(_Model):
    """A whole load scenario (see the module docstring). Times in seconds from the start of the run.

    Requests arrive during ``[0, duration_s)``; those arriving before ``warmup_s`` are sent but left out of
    the report. ``max_requests`` caps the plan (earliest first). ``seed`` makes the plan reproducible.
    """

    name: str = "scenario"
    description: str = ""
    seed: int = 0
    duration_s: float = Field(..., gt=0)
    warmup_s: float = Field(0.0, ge=0)
    max_requests: int | None = Field(None, ge=1)
    target: Target = Field(default_factory=Target)
    tenants: list[Tenant] = Field(..., min_length=1)
    slo: dict[str, ClassSLO] = Field(..., description="SLO per priority class name.")
    arrival: Arrival = Field(default_factory=Arrival)
    prompts: PromptMix = Field(default_factory=PromptMix)

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        if self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s ({self.warmup_s}) must be below duration_s ({self.duration_s})")
        ids = [t.id for t in self.tenants]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate tenant ids: {', '.join(dupes)}")
        missing = sorted({t.priority_class for t in self.tenants} - set(self.slo))
        if missing:
            raise ValueError(f"no 'slo' entry for priority class(es) used by tenants: {', '.join(missing)}")
        return self

    def tenant(self, tenant_id: str) -> Tenant:
        """The tenant with this id (KeyError if none)."""
        for t in self.tenants:
            if t.id == tenant_id:
                return t
        raise KeyError(tenant_id)


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    """Validate a scenario from already-parsed data (a dict); raises :class:`ScenarioError`."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as err:
        raise ScenarioError(f"{source}: invalid scenario\n{_format_errors(err)}") from err


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file: ``.yaml``/``.yml``, ``.toml`` or ``.json`` (by suffix).

    Raises:
        ScenarioError: unreadable file, unknown suffix, syntax error, or validation errors (all listed).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ScenarioError(f"{p}: cannot read: {err}") from err
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ScenarioError(f"{p}: unknown scenario format {suffix!r} (use .yaml, .yml, .toml or .json)")
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ScenarioError(f"{p}: syntax error: {err}") from err
    return parse_scenario(data, str(p))


# ---------------------------------------------------------------- planning (pure)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message (OpenAI shape)."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of the plan.

    ``arrival_s``: seconds from the run's start. ``warmup``: arrives before ``warmup_s`` (sent, not reported).
    ``session_id`` / ``turn``: the conversation and its 0-based turn. ``user_id``: ``tenant/user-k``.
    ``system_prompt_id``: which shared system prompt (``None`` when the scenario has none).
    ``prompt_words``: words in all messages (≈ prompt tokens, without the chat template).
    """

    index: int
    arrival_s: float
    tenant: str
    priority_class: str
    session_id: str
    turn: int
    user_id: str
    system_prompt_id: str | None
    messages: tuple[ChatMessage, ...]
    max_tokens: int
    stream: bool
    warmup: bool
    prompt_words: int

    def body(self, model: str, ignore_eos: bool = True, priority: bool = False) -> dict[str, Any]:
        """The ``/v1/chat/completions`` JSON body."""
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": m.role, "content": m.content} for m in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if ignore_eos:
            body["ignore_eos"] = True
        if priority:
            body["priority"] = self.priority_class
        return body


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def arrival_times(
    arrival: Arrival, horizon_s: float, rng: random.Random, rate_scale: float = 1.0
) -> list[float]:
    """Arrival times (s) in ``[0, horizon_s)`` of the arrival process, its rate multiplied by ``rate_scale``.

    Time rescaling: unit-mean gaps (exponential, or gamma with the given cv) accumulate in "expected
    arrivals" Λ, mapped back to time through the piecewise-linear cumulative rate Λ(t).
    """
    steps = arrival.steps()
    starts = [s.at_s for s in steps]
    cum = [0.0]  # Λ at each step start
    for a, b in itertools.pairwise(steps):
        cum.append(cum[-1] + a.rate_rps * rate_scale * (b.at_s - a.at_s))
    total = cum[-1] + steps[-1].rate_rps * rate_scale * max(0.0, horizon_s - steps[-1].at_s)
    shape = 1.0 / arrival.cv**2
    times: list[float] = []
    lam = 0.0
    while True:
        gap = rng.expovariate(1.0) if arrival.process == "poisson" else rng.gammavariate(shape, 1.0 / shape)
        lam += gap
        if lam >= total:
            return times
        # the last step whose Λ starts at or below lam: its rate is > 0 since lam < total (flat Λ is skipped)
        i = bisect.bisect_right(cum, lam) - 1
        t = starts[i] + (lam - cum[i]) / (steps[i].rate_rps * rate_scale)
        if t < horizon_s:
            times.append(t)


def generate_requests(scenario: Scenario) -> list[PlannedRequest]:
    """The whole plan of a scenario, sorted by arrival time (pure; same scenario and seed → same plan).

    Sessions start by the arrival process at ``rate / mean turns``; each picks a tenant by share, one of the
    tenant's users (thus its system prompt), a number of turns; turn ``k+1`` arrives an exponential think
    time (mean ``think_time_s``) after turn ``k``. Turns arriving after ``duration_s`` are dropped; the
    first ``max_requests`` by arrival time are kept.
    """
    rng = random.Random(f"radixgate-loadgen:{scenario.seed}")
    mix = scenario.prompts
    sp = mix.system_prompts
    mean_turns = max(1.0, mix.sessions.turns.expected)
    starts = arrival_times(scenario.arrival, scenario.duration_s, rng, 1.0 / mean_turns)
    tenants = scenario.tenants
    cum_share = []
    acc = 0.0
    for tenant_spec in tenants:
        acc += tenant_spec.share
        cum_share.append(acc)

    prompt_cache: dict[str, str] = {}

    def system_prompt(key: str) -> str:
        if key not in prompt_cache:
            prng = random.Random(f"radixgate-loadgen:{scenario.seed}:system:{key}")
            length = sp.length.sample(prng)
            prompt_cache[key] = f"You are assistant {key}. " + _words(prng, max(0, length - 4))
        return prompt_cache[key]

    n_users = sp.count * sp.users_per_prompt if sp.count else sp.users_per_prompt
    draft: list[tuple[float, int, int, PlannedRequest]] = []
    for s_index, t0 in enumerate(starts):
        tenant = tenants[bisect.bisect_left(cum_share, rng.random() * acc)]
        user = rng.randrange(n_users)
        prompt_no = user // sp.users_per_prompt if sp.count else None
        scope = "all" if sp.shared_across_tenants else tenant.id
        prompt_id = f"{scope}-{prompt_no}" if prompt_no is not None else None
        user_id = f"{tenant.id}/user-{user}"
        session_id = f"s{s_index}"
        history: list[ChatMessage] = []
        if prompt_id is not None:
            history.append(ChatMessage("system", system_prompt(prompt_id)))
        turns = max(1, mix.sessions.turns.sample(rng))
        t = t0
        for turn in range(turns):
            if turn:
                t += rng.expovariate(1.0 / mix.sessions.think_time_s) if mix.sessions.think_time_s else 0.0
            user_len = max(1, mix.user_turn.sample(rng))
            max_tokens = max(1, mix.output.sample(rng))
            stream = rng.random() < mix.stream_ratio
            content = f"Question {s_index}.{turn}: " + _words(rng, max(0, user_len - 2))
            history.append(ChatMessage("user", content))
            if t < scenario.duration_s:
                messages = tuple(history)
                draft.append(
                    (
                        t,
                        s_index,
                        turn,
                        PlannedRequest(
                            index=-1,
                            arrival_s=t,
                            tenant=tenant.id,
                            priority_class=tenant.priority_class,
                            session_id=session_id,
                            turn=turn,
                            user_id=user_id,
                            system_prompt_id=prompt_id,
                            messages=messages,
                            max_tokens=max_tokens,
                            stream=stream,
                            warmup=t < scenario.warmup_s,
                            prompt_words=sum(len(m.content.split()) for m in messages),
                        ),
                    )
                )
            history.append(ChatMessage("assistant", _words(rng, max_tokens)))
    draft.sort(key=lambda d: (d[0], d[1], d[2]))
    if scenario.max_requests is not None:
        draft = draft[: scenario.max_requests]
    return [replace(req, index=i) for i, (_, _, _, req) in enumerate(draft)]
