"""The tenants dashboard (``radixgate-tenants``): who uses the gateway, who is refused, who talks most.

Tenant label values are bounded (``observability.max_tenant_labels``, for the whole host): the first N
tenants seen keep their id, the rest count together as ``other``, so a large ``other`` means the top
talkers are not all named here. Top-N panels rank over the dashboard's time range (``$__range``).
"""

from __future__ import annotations

from service.observability.dashboards.kit import (
    RATE,
    TOKENS_PER_S,
    Board,
    Query,
    choice_variable,
    label_variable,
    timeseries,
    top,
)

TENANT = 'tenant=~"$tenant"'
OTHER = " Tenants past the label cap count as other."


def build() -> Board:
    """The tenants dashboard."""
    board = (
        Board(
            "radixgate-tenants",
            "radixgate / tenants",
            "Per tenant: tokens, requests, quota refusals (429/413), shedding and latency; the top talkers "
            "over the time range.",
        )
        .variable(
            label_variable(
                "tenant",
                "tenant",
                "radixgate_requests_total",
                "Tenant",
                "Tenants with their own label (the first max_tenant_labels seen; the rest are other).",
            )
        )
        .variable(choice_variable("topn", "Top N", ["5", "10", "20", "50"], "10"))
    )
    board.row("Top talkers (over the time range)")
    board.panel(
        top(
            "Top tenants by tokens",
            "Prompt + completion tokens served over the dashboard's time range, the $topn largest." + OTHER,
            "short",
            Query(
                "topk($topn, sum by (tenant) (increase(radixgate_prompt_tokens_total[$__range]))\n"
                "+ sum by (tenant) (increase(radixgate_completion_tokens_total[$__range])))",
                "{{tenant}}",
            ),
            width=8,
        )
    )
    board.panel(
        top(
            "Top tenants by requests",
            "Completed API requests (any status) over the time range, the $topn largest." + OTHER,
            "short",
            Query(
                "topk($topn, sum by (tenant) (increase(radixgate_requests_total[$__range])))", "{{tenant}}"
            ),
            width=8,
        )
    )
    board.panel(
        top(
            "Most refused tenants",
            "Token-bucket refusals (429 rate_limited and 413 exceeds_burst) over the time range." + OTHER,
            "short",
            Query(
                "topk($topn, sum by (tenant) (increase(radixgate_quota_rejections_total[$__range])))",
                "{{tenant}}",
            ),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Request rate of the top tenants",
            "Requests per second of the $topn busiest tenants at each instant.",
            "reqps",
            Query(
                f"topk($topn, sum by (tenant) (rate(radixgate_requests_total{{{TENANT}}}[{RATE}])))",
                "{{tenant}}",
            ),
            width=24,
        )
    )

    board.row("Tokens")
    board.panel(
        timeseries(
            "Prompt tokens per second",
            "Prompt tokens served per tenant (the prompt's size, charged or not).",
            TOKENS_PER_S,
            Query(f"sum by (tenant) (rate(radixgate_prompt_tokens_total{{{TENANT}}}[{RATE}]))", "{{tenant}}"),
            width=8,
            stack=True,
        )
    )
    board.panel(
        timeseries(
            "Completion tokens per second",
            "Tokens generated per tenant.",
            TOKENS_PER_S,
            Query(
                f"sum by (tenant) (rate(radixgate_completion_tokens_total{{{TENANT}}}[{RATE}]))",
                "{{tenant}}",
            ),
            width=8,
            stack=True,
        )
    )
    board.panel(
        timeseries(
            "Cached share of prompt tokens",
            "Prompt tokens the worker served from its prefix cache (engine-reported in each answer's "
            "usage) / prompt tokens, per tenant.",
            "percentunit",
            Query(
                f"sum by (tenant) (rate(radixgate_cached_tokens_total{{{TENANT}}}[{RATE}]))\n"
                f"/ sum by (tenant) (rate(radixgate_prompt_tokens_total{{{TENANT}}}[{RATE}]))",
                "{{tenant}}",
            ),
            width=8,
            max_val=1,
        )
    )

    board.row("Refusals and errors")
    board.panel(
        timeseries(
            "Quota refusals per tenant",
            "Token-bucket refusals per second by tenant and reason: rate_limited (429) or exceeds_burst "
            "(413), nothing charged.",
            "reqps",
            Query(
                f"sum by (tenant, reason) (rate(radixgate_quota_rejections_total{{{TENANT}}}[{RATE}]))",
                "{{tenant}} {{reason}}",
            ),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Shed per tenant",
            "Requests of the tenant that admission control shed per second (503 overloaded).",
            "reqps",
            Query(
                "sum by (tenant) "
                f'(rate(radixgate_scheduler_outcomes_total{{{TENANT}, outcome="shed"}}[{RATE}]))',
                "{{tenant}}",
            ),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Non-200 answers per tenant",
            "Admitted requests that ended with another status than 200, per tenant and status.",
            "reqps",
            Query(
                "sum by (tenant, status) "
                f'(rate(radixgate_requests_total{{{TENANT}, status!="200"}}[{RATE}]))',
                "{{tenant}} {{status}}",
            ),
            width=8,
        )
    )

    board.row("Latency per tenant")
    board.panel(
        timeseries(
            "TTFT P99 per tenant",
            "99th percentile time to first token per tenant (radixgate_time_to_first_token_seconds).",
            "s",
            Query(
                "histogram_quantile(0.99, sum by (tenant, le) "
                f"(rate(radixgate_time_to_first_token_seconds_bucket{{{TENANT}}}[{RATE}])))",
                "{{tenant}}",
            ),
        )
    )
    board.panel(
        timeseries(
            "End-to-end P99 per tenant",
            "99th percentile arrival-to-last-byte time per tenant (radixgate_request_latency_seconds).",
            "s",
            Query(
                "histogram_quantile(0.99, sum by (tenant, le) "
                f"(rate(radixgate_request_latency_seconds_bucket{{{TENANT}}}[{RATE}])))",
                "{{tenant}}",
            ),
        )
    )
    return board
