"""From a load scenario (``loadgen.scenario``) to the fleet simulation, and back to the runner's records.

The HTTP runner and the fleet simulation drive the same plan (:func:`loadgen.scenario.generate_requests`)
and are reported by the same code (:func:`loadgen.report.build_report` over
:class:`loadgen.runner.RequestRecord`), so figures from virtual time and from a real run mean the same.

- Prompts are rendered as the gateway renders them for the ChatML template of the stub tokenizer and of
  SmolLM2 (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n``), so
  the pseudo-tokenizer counts what the gateway counts in the cross-check. A Llama-3 template adds a few
  more header tokens per message; immaterial for requests of hundreds of tokens.
- Tenants' ``quotas`` keys are the admin API's (``requests_per_min``, ``tokens_per_min``,
  ``request_burst``, ``token_burst``).
- Record mapping: TTFT only for streamed requests (as the runner measures it), E2E for every served one,
  status per :data:`loadgen.fleet.records.HTTP_STATUS`; ``sent_s`` is the planned arrival (virtual time
  has no send lag).
"""

from __future__ import annotations

from collections.abc import Sequence

from loadgen.fleet.config import FleetRequest, TenantSpec
from loadgen.fleet.records import HTTP_STATUS, FleetResult
from loadgen.runner import RequestRecord
from loadgen.scenario import ChatMessage, PlannedRequest, Scenario


def render_chatml(messages: Sequence[ChatMessage]) -> str:
    """The prompt text the gateway sends for ``messages`` with a ChatML chat template."""
    parts = [f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def tenant_specs(scenario: Scenario) -> dict[str, TenantSpec]:
    """The scenario's tenants as the gateway would hold them (weight, class, quotas)."""
    out: dict[str, TenantSpec] = {}
    for t in scenario.tenants:
        q = t.quotas or {}
        out[t.id] = TenantSpec(
            id=t.id,
            weight=t.weight,
            priority_class=t.priority_class,
            requests_per_min=q.get("requests_per_min"),
            tokens_per_min=q.get("tokens_per_min"),
            request_burst=q.get("request_burst"),
            token_burst=q.get("token_burst"),
        )
    return out


def fleet_requests(plan: Sequence[PlannedRequest]) -> list[FleetRequest]:
    """The plan as fleet requests (rid = ``p<index>``; rendered ChatML prompt; the tenant's class)."""
    return [
        FleetRequest(
            rid=f"p{p.index}",
            arrival_s=p.arrival_s,
            tenant=p.tenant,
            prompt=render_chatml(p.messages),
            max_tokens=p.max_tokens,
            priority_class=p.priority_class,
        )
        for p in plan
    ]


def runner_records(plan: Sequence[PlannedRequest], result: FleetResult) -> list[RequestRecord]:
    """One :class:`loadgen.runner.RequestRecord` per planned request, from a fleet run over ``plan``.

    Raises:
        KeyError: ``result`` is not a run over ``plan`` (a planned rid has no record).
    """
    by_rid = {r.rid: r for r in result.records}
    out: list[RequestRecord] = []
    for p in plan:
        f = by_rid[f"p{p.index}"]
        rec = RequestRecord(
            index=p.index,
            tenant=p.tenant,
            priority_class=f.band,
            session_id=p.session_id,
            turn=p.turn,
            stream=p.stream,
            warmup=p.warmup,
            max_tokens=p.max_tokens,
            scheduled_s=p.arrival_s,
            sent_s=p.arrival_s,
            status=HTTP_STATUS[f.outcome],
        )
        if f.outcome == "unfinished":
            rec.error = "unfinished when the simulation stopped"
        if f.outcome == "ok":
            ttft, e2e = f.ttft_s, f.e2e_s
            rec.ttft_ms = ttft * 1000 if p.stream and ttft is not None else None
            rec.e2e_ms = e2e * 1000 if e2e is not None else None
            rec.prompt_tokens = f.prompt_tokens
            rec.completion_tokens = f.completion_tokens
            rec.cached_tokens = f.cached_tokens
            rec.finish_reason = "length"
        out.append(rec)
    return out
