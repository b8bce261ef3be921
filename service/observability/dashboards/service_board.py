"""The service dashboard (``radixgate-service``): per priority class, did the gateway keep its goals?

TTFT, TPOT and end-to-end quantiles, goodput, shedding, and the 429/413 refusals. The top row reads the
recording rules of ``deploy/prometheus/rules/recording.yml`` (per class, every model: the numbers the
alerts fire on); the per-model row computes the same quantiles from the histograms of
:mod:`service.observability.class_metrics` (``{class, model}``, buckets 1 ms to 120 s) so one model can be
looked at alone. A row of the gateway's own time (ITL, overhead, event-loop lag, store calls, request
phases: :mod:`service.observability.phase_metrics`, :mod:`service.observability.runtime_metrics`) reads
their P99 recording rules.
"""

from __future__ import annotations

from service.observability.dashboards.kit import (
    RATE,
    TOKENS_PER_S,
    Board,
    Query,
    label_variable,
    stat,
    timeseries,
)

CLASS = 'class=~"$class"'
SELECT = 'model=~"$model", class=~"$class"'
GOOD = [(None, "red"), (0.95, "orange"), (0.99, "green")]


def _quantiles(metric: str) -> tuple[Query, ...]:
    """P50, P90 and P99 of histogram ``metric`` per class and model, over the selected ones."""
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (class, model, le) (rate({metric}_bucket{{{SELECT}}}[{RATE}])))",
            f"p{round(q * 100)} {{{{class}}}} {{{{model}}}}",
        )
        for q in (0.5, 0.9, 0.99)
    )


def _recorded(metric: str) -> tuple[Query, ...]:
    """The P50 and P99 recording rules of ``metric`` per class (5 m windows)."""
    return tuple(Query(f"class:{metric}:{p}_5m{{{CLASS}}}", f"{p} {{{{class}}}}") for p in ("p50", "p99"))


def build() -> Board:
    """The service dashboard."""
    board = (
        Board(
            "radixgate-service",
            "radixgate / service",
            "Per priority class: TTFT, TPOT and end-to-end latency, goodput (served within the class's TTFT "
            "goal), shedding, and 429/413 refusals.",
        )
        .variable(
            label_variable("model", "model", "radixgate_class_requests_total", "Model", "The served models.")
        )
        .variable(
            label_variable(
                "class",
                "class",
                'radixgate_class_requests_total{model=~"$model"}',
                "Class",
                "Priority classes (the scheduler's bands).",
            )
        )
    )
    board.row("SLOs per class (recording rules: what the alerts read)")
    board.panel(
        stat(
            "Goodput (5 m)",
            "Requests served within their class's TTFT goal / requests the class had to serve (served, "
            "error, shed). Recording rule class:radixgate_goodput:ratio_rate5m.",
            "percentunit",
            Query(f"class:radixgate_goodput:ratio_rate5m{{{CLASS}}}", "{{class}}"),
            width=8,
            steps=GOOD,
        )
    )
    board.panel(
        stat(
            "Shed (5 m)",
            "Share of the band's requests shed by admission control (503): shed / (admitted + shed + "
            "expired). Recording rule band:radixgate_shed:ratio_rate5m; the shed-rate alert fires above 5%.",
            "percentunit",
            Query('band:radixgate_shed:ratio_rate5m{band=~"$class"}', "{{band}}"),
            width=8,
            steps=[(None, "green"), (0.01, "orange"), (0.05, "red")],
        )
    )
    board.panel(
        stat(
            "TTFT P99 (5 m)",
            "99th percentile time to first token of served requests per class, every model.",
            "s",
            Query(f"class:radixgate_class_ttft_seconds:p99_5m{{{CLASS}}}", "{{class}}"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "TTFT P50 and P99",
            "Time to first token of served requests per class (recording rules, 5 m windows). A "
            "non-streamed answer counts only when the worker reported its first token's time.",
            "s",
            *_recorded("radixgate_class_ttft_seconds"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "TPOT P50 and P99",
            "Mean time per output token after the first, (e2e - ttft) / (completion_tokens - 1), per "
            "class (recording rules). Rising TPOT with a steady batch: decode is memory-bandwidth bound.",
            "s",
            *_recorded("radixgate_class_tpot_seconds"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "End-to-end P50 and P99",
            "Arrival to the last byte of served requests per class (recording rules).",
            "s",
            *_recorded("radixgate_class_e2e_seconds"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Goodput per class",
            "Served within the class's TTFT goal / served + error + shed, 5 m windows.",
            "percentunit",
            Query(f"class:radixgate_goodput:ratio_rate5m{{{CLASS}}}", "{{class}}"),
            width=8,
            max_val=1,
        )
    )
    board.panel(
        timeseries(
            "TTFT SLO error ratio",
            "Share of served requests that missed the class's TTFT goal, over 5 m and 1 h. The fast-burn "
            "alert fires when both exceed 14.4 x the 1% budget (14.4%), the slow one at 6 x over 6 h and "
            "30 m (Google SRE workbook, ch. 5).",
            "percentunit",
            Query(f"class:radixgate_ttft_slo_errors:ratio_rate5m{{{CLASS}}}", "5m {{class}}"),
            Query(f"class:radixgate_ttft_slo_errors:ratio_rate1h{{{CLASS}}}", "1h {{class}}"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Goodput SLO error ratio",
            "Share of the requests a class had to serve (served, error, shed) that were not served "
            "within its TTFT goal, over 5 m and 1 h (same burn factors as TTFT).",
            "percentunit",
            Query(f"class:radixgate_goodput_slo_errors:ratio_rate5m{{{CLASS}}}", "5m {{class}}"),
            Query(f"class:radixgate_goodput_slo_errors:ratio_rate1h{{{CLASS}}}", "1h {{class}}"),
            width=8,
        )
    )

    board.row("Where the time goes: the gateway's own time (recording rules)")
    board.panel(
        timeseries(
            "ITL P50 and P99",
            "Inter-token latency per class: the gaps between a stream's tokens as the gateway relays "
            "them (recording rules over radixgate_class_itl_seconds).",
            "s",
            *_recorded("radixgate_class_itl_seconds"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Gateway overhead P99",
            "The gateway's own time per request (neither its queue, nor a worker, nor the client) at "
            "P99, per replica. Above 50 ms for 10 m: the gateway-overhead alert.",
            "s",
            Query("instance:radixgate_gateway_overhead_seconds:p99_5m", "{{instance}}"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Event-loop lag P99",
            "How late each replica's event loop wakes a sleeping task, P99: every callback on the "
            "process waits as long. Above 100 ms for 5 m: the event-loop-lag alert.",
            "s",
            Query("instance:radixgate_event_loop_lag_seconds:p99_5m", "{{instance}}"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Store call latency P99",
            "Each quota-store (Redis) call's latency at P99 per replica and operation (reserve, settle, "
            "authenticate...), the pool and pipeline waits included. Above 50 ms for 10 m: the "
            "Redis-slow alert.",
            "s",
            Query("instance_op:radixgate_store_call_seconds:p99_5m", "{{instance}} {{op}}"),
        )
    )
    board.panel(
        timeseries(
            "Request phases P99",
            "P99 of each phase of a request (auth, prepare, quota, route, queue, upstream_connect, the "
            "engine's tokenize, queue and prefill, decode, client_write), every replica: the phase whose "
            "P99 rises with the TTFT is where the tail comes from.",
            "s",
            Query("phase:radixgate_request_phase_seconds:p99_5m", "{{phase}}"),
        )
    )

    board.row("Per model (histograms)")
    board.panel(
        timeseries(
            "TTFT quantiles per class and model",
            "P50, P90 and P99 from radixgate_class_ttft_seconds (buckets 1 ms to 120 s).",
            "s",
            *_quantiles("radixgate_class_ttft_seconds"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "TPOT quantiles per class and model",
            "P50, P90 and P99 from radixgate_class_tpot_seconds.",
            "s",
            *_quantiles("radixgate_class_tpot_seconds"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "End-to-end quantiles per class and model",
            "P50, P90 and P99 from radixgate_class_e2e_seconds.",
            "s",
            *_quantiles("radixgate_class_e2e_seconds"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Outcomes per class",
            "Finished requests per second by outcome: served, shed (503 admission control), rejected "
            "(4xx), cancelled (499, the client left), error (5xx).",
            "reqps",
            Query(
                f"sum by (class, outcome) (rate(radixgate_class_requests_total{{{SELECT}}}[{RATE}]))",
                "{{class}} {{outcome}}",
            ),
            stack=True,
        )
    )
    board.panel(
        timeseries(
            "Goodput per class and model",
            "Served within the TTFT goal / served + error + shed, per class and model.",
            "percentunit",
            Query(
                f"sum by (class, model) (rate(radixgate_class_goodput_total{{{SELECT}}}[{RATE}]))\n"
                f"/ sum by (class, model) (rate(radixgate_class_requests_total"
                f'{{{SELECT}, outcome=~"served|error|shed"}}[{RATE}]))',
                "{{class}} {{model}}",
            ),
            max_val=1,
        )
    )

    board.row("Admission, quotas and refusals")
    board.panel(
        timeseries(
            "Shed per band and reason",
            "Requests shed by admission control per second (503 overloaded), by reason. Recording rule "
            "band_reason:radixgate_shed:rate5m.",
            "reqps",
            Query('band_reason:radixgate_shed:rate5m{band=~"$class"}', "{{band}} {{reason}}"),
            width=8,
            stack=True,
        )
    )
    board.panel(
        timeseries(
            "429 and 413",
            "Token-bucket refusals per second: rate_limited is 429 (the bucket is short for now, retry "
            "after), exceeds_burst is 413 (the request needs more than the bucket's burst and can never "
            "pass). Beside them every 429 and 413 answered before admission (quota, and bodies over the "
            "size bound), by error code.",
            "reqps",
            Query(
                f"sum by (reason, bucket) (rate(radixgate_quota_rejections_total[{RATE}]))",
                "quota {{reason}} ({{bucket}})",
            ),
            Query(
                "sum by (status, code) "
                f'(rate(radixgate_rejected_requests_total{{status=~"429|413"}}[{RATE}]))',
                "{{status}} {{code}}",
            ),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Scheduler outcomes per band",
            "What the scheduler did with each request per second: admitted, shed, expired (waited past "
            "its deadline in the gateway queue), cancelled.",
            "reqps",
            Query(
                "sum by (band, outcome) "
                f'(rate(radixgate_scheduler_outcomes_total{{band=~"$class"}}[{RATE}]))',
                "{{band}} {{outcome}}",
            ),
            width=8,
            stack=True,
        )
    )
    board.panel(
        timeseries(
            "Gateway queue",
            "Requests waiting in the gateway's queue per band, and requests in flight to workers (every "
            "replica summed).",
            "short",
            Query('sum by (band) (radixgate_queue_depth{band=~"$class"})', "queued {{band}}"),
            Query("sum(radixgate_in_flight_requests)", "in flight"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Gateway queue wait P99",
            "99th percentile of the time admitted requests waited in the gateway's queue, per band.",
            "s",
            Query(
                "histogram_quantile(0.99, sum by (band, le) "
                f'(rate(radixgate_queue_wait_seconds_bucket{{band=~"$class"}}[{RATE}])))',
                "p99 {{band}}",
            ),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Tokens per second",
            "Prompt and completion tokens served per second, every tenant (recording rules).",
            TOKENS_PER_S,
            Query("radixgate:prompt_tokens:rate5m", "prompt"),
            Query("radixgate:completion_tokens:rate5m", "completion"),
            width=8,
        )
    )
    return board
