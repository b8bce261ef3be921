"""The workers and routing dashboard (``radixgate-workers``): each worker as the gateway sees it (health,
breaker, load against its concurrency window, errors, routing) beside what the worker's SGLang engine
reports on its own ``/metrics`` (``sglang:*``: running and queued requests, KV pool, throughput, prefix
cache).

Two label sets: the gateway's series name a worker by its URL (``worker``), SGLang's by the Prometheus
target that scraped it (``instance``, host:port of the same worker), hence two variables. The engine's
gauges also come re-exported by the gateway under the worker's URL and model (``radixgate_engine_*``,
:mod:`service.observability.pool_gauges`): the row "Engine as the gateway scrapes it" reads those, so a
worker's engine queue and KV usage line up with the gateway's own series for it without relabelling.
"""

from __future__ import annotations

from service.observability.dashboards.kit import (
    RATE,
    TOKENS_PER_S,
    Board,
    Query,
    label_variable,
    states,
    timeseries,
)

WORKER = 'worker=~"$worker"'
INSTANCE = 'instance=~"$instance"'


def build() -> Board:
    """The workers and routing dashboard."""
    board = (
        Board(
            "radixgate-workers",
            "radixgate / workers and routing",
            "Per worker: rotation and breakers, load against the concurrency window, errors and retries, "
            "routing; the SGLang engine's queue, KV pool and throughput; prefix-cache hit rate as the "
            "router predicts it against what the engine reports.",
        )
        .variable(
            label_variable(
                "worker", "worker", "radixgate_worker_healthy", "Worker", "Workers by URL (gateway side)."
            )
        )
        .variable(
            label_variable(
                "instance",
                "instance",
                "sglang:num_running_reqs",
                "Engine",
                "SGLang workers by scrape target (engine side).",
            )
        )
    )
    board.row("Rotation and breakers")
    board.panel(
        states(
            "In rotation",
            "1: every gateway replica sends the worker traffic (health checks pass, circuit breaker not "
            "open); 0: at least one replica has it out of rotation. Recording rule "
            "worker:radixgate_worker_healthy:min.",
            {"1": ("in rotation", "green"), "0": ("out", "red")},
            Query(f"worker:radixgate_worker_healthy:min{{{WORKER}}}", "{{worker}}"),
        )
    )
    board.panel(
        timeseries(
            "Breaker transitions",
            "Circuit-breaker state changes per worker and new state (open, half_open, closed) in each "
            "interval. An open with no closed after it: the worker is out; open, half_open, open again "
            "over and over: it is flapping (the breaker-flapping alert counts 3 opens in 15 m).",
            "short",
            Query(
                f"sum by (worker, state) (increase(radixgate_breaker_transitions_total{{{WORKER}}}[{RATE}]))",
                "{{worker}} {{state}}",
            ),
            bars=True,
        )
    )
    board.panel(
        timeseries(
            "Upstream errors",
            "Failed worker calls per second by worker and kind (transport, http_<status>, pool_exhausted).",
            "reqps",
            Query(
                f"sum by (worker, kind) (rate(radixgate_upstream_errors_total{{{WORKER}}}[{RATE}]))",
                "{{worker}} {{kind}}",
            ),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Retries",
            "Requests sent again to another worker, per second: before the first token, or resumed in "
            "the middle of a stream.",
            "reqps",
            Query(f"sum by (kind) (rate(radixgate_retries_total[{RATE}]))", "{{kind}}"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Worker restarts",
            "Workers the gateway's supervisor restarted, per interval and reason.",
            "short",
            Query(
                f"sum by (worker, reason) (increase(radixgate_worker_restarts_total{{{WORKER}}}[{RATE}]))",
                "{{worker}} {{reason}}",
            ),
            width=8,
            bars=True,
        )
    )

    board.row("Load and windows (gateway side)")
    board.panel(
        timeseries(
            "In flight against window",
            "Requests the gateway has in flight on each worker, and the worker's concurrency window "
            "(the adaptive limit the scheduler admits up to), every replica summed.",
            "short",
            Query(
                f"sum by (worker) (radixgate_worker_in_flight_requests{{{WORKER}}})", "{{worker}} in flight"
            ),
            Query(f"sum by (worker) (radixgate_worker_window_requests{{{WORKER}}})", "{{worker}} window"),
        )
    )
    board.panel(
        timeseries(
            "Saturation",
            "In flight / window of each healthy worker. Every worker at 0.9 or more with requests queued "
            "in the gateway: the fleet is at capacity (all-workers-saturated alert).",
            "percentunit",
            Query(f"worker:radixgate_worker_saturation:ratio{{{WORKER}}}", "{{worker}}"),
        )
    )
    board.panel(
        timeseries(
            "Routing decisions",
            "Routing decisions per second by policy and reason (cache_aware: cache_hit, cache_miss, "
            "imbalance).",
            "reqps",
            Query(
                f"sum by (policy, reason) (rate(radixgate_routing_decisions_total[{RATE}]))",
                "{{policy}} {{reason}}",
            ),
            stack=True,
        )
    )
    board.panel(
        timeseries(
            "Gateway queue against engine queue",
            "Requests waiting in the gateway (per band) and in the engines' own waiting queues (every "
            "selected engine summed). A long engine queue with an empty gateway queue: the windows "
            "admit more than the engines run.",
            "short",
            Query("sum by (band) (radixgate_queue_depth)", "gateway {{band}}"),
            Query(f"sum(sglang:num_queue_reqs{{{INSTANCE}}})", "engines"),
        )
    )

    board.row("Engine (SGLang /metrics)")
    board.panel(
        timeseries(
            "Engine running and queued",
            "Requests each SGLang engine runs (its batch: prefilling or decoding) and holds waiting.",
            "short",
            Query(f"sum by (instance) (sglang:num_running_reqs{{{INSTANCE}}})", "{{instance}} running"),
            Query(f"instance:sglang_num_queue_reqs:max{{{INSTANCE}}}", "{{instance}} queued"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "KV cache usage",
            "Used share of each engine's KV pool. Above 0.95 for 10 m the engine retracts running "
            "requests and admits new ones late (KV-cache-full alert).",
            "percentunit",
            Query(f"instance:sglang_token_usage:max{{{INSTANCE}}}", "{{instance}}"),
            width=8,
            max_val=1,
        )
    )
    board.panel(
        timeseries(
            "Generation throughput",
            "Tokens each engine generates per second (its own gauge).",
            TOKENS_PER_S,
            Query(f"sum by (instance) (sglang:gen_throughput{{{INSTANCE}}})", "{{instance}}"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Retractions and aborts",
            "Requests the engine retracted (KV pressure: they restart their prefill later) and aborted, "
            "per second.",
            "reqps",
            Query(
                f"sum by (instance) (rate(sglang:num_retracted_requests_total{{{INSTANCE}}}[{RATE}]))",
                "{{instance}} retracted",
            ),
            Query(
                f"sum by (instance) (rate(sglang:num_aborted_requests_total{{{INSTANCE}}}[{RATE}]))",
                "{{instance}} aborted",
            ),
        )
    )
    board.panel(
        timeseries(
            "Speculative decoding accept length",
            "Mean tokens accepted per verification step, when the engine runs speculative decoding "
            "(absent otherwise).",
            "short",
            Query(f"avg by (instance) (sglang:spec_accept_length{{{INSTANCE}}})", "{{instance}}"),
        )
    )

    board.row("Engine as the gateway scrapes it (per worker URL and model)")
    board.panel(
        timeseries(
            "Gateway queue against engine queue, per worker",
            "Per worker: requests the gateway's admission core holds for it (every replica summed) and "
            "requests waiting in its engine's own queue (radixgate_engine_queued_requests, the gateway's "
            "scrape of sglang:num_queue_reqs every observability.engine_scrape_s). A long engine queue "
            "behind an empty gateway queue: the window admits more than the engine runs.",
            "short",
            Query(
                f"sum by (worker, model) (radixgate_worker_queued_requests{{{WORKER}}})",
                "{{worker}} gateway",
            ),
            Query(f"worker:radixgate_engine_queued_requests:max{{{WORKER}}}", "{{worker}} engine"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "KV cache usage per worker",
            "Used share of each worker's KV pool as its engine reports it (sglang:token_usage, scraped "
            "by the gateway; labelled by worker URL and model, so it lines up with the gateway's own "
            "series). Near 1: the engine retracts running requests and admits new ones late.",
            "percentunit",
            Query(f"worker:radixgate_engine_token_usage:max{{{WORKER}}}", "{{worker}} {{model}}"),
            width=8,
            max_val=1,
        )
    )
    board.panel(
        timeseries(
            "Engine running against window",
            "Requests each engine runs (its batch) against the worker's concurrency window in the "
            "gateway. Running well under the window with requests queued in the engine: the engine is "
            "bounded by its KV pool or max_running_requests, not by the gateway.",
            "short",
            Query(f"max by (worker) (radixgate_engine_running_requests{{{WORKER}}})", "{{worker}} running"),
            Query(f"sum by (worker) (radixgate_worker_window_requests{{{WORKER}}})", "{{worker}} window"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Cache hit rate per worker: router's prediction against engine-reported",
            "The router's predicted prefix-cache hit over every worker (characters it expected cached) "
            "against each engine's own hit-rate gauge (sglang:cache_hit_rate as the gateway scrapes it). "
            "One worker far below the prediction: its cache was evicted or flushed behind the router.",
            "percentunit",
            Query("radixgate:routing_predicted_cache_hit:ratio_rate5m", "gateway: router's prediction"),
            Query(f"worker:radixgate_engine_cache_hit_rate:avg{{{WORKER}}}", "engine {{worker}}"),
            max_val=1,
        )
    )
    board.panel(
        timeseries(
            "Engine generation throughput",
            "Tokens per second each engine reports generating (sglang:gen_throughput, scraped by the "
            "gateway), and the fleet's total (recording rule radixgate:engine_gen_throughput:sum).",
            TOKENS_PER_S,
            Query(f"max by (worker) (radixgate_engine_gen_throughput{{{WORKER}}})", "{{worker}}"),
            Query("radixgate:engine_gen_throughput:sum", "every worker"),
            width=6,
        )
    )
    board.panel(
        timeseries(
            "Speculative decoding per worker",
            "Mean tokens accepted per verify step and the accepted share of draft tokens, from workers "
            "that run speculative decoding (absent otherwise). A falling accept length: each step "
            "yields fewer tokens and TPOT rises.",
            "short",
            Query(
                f"max by (worker) (radixgate_engine_spec_accept_length{{{WORKER}}})",
                "{{worker}} accept length",
            ),
            Query(
                f"max by (worker) (radixgate_engine_spec_accept_rate{{{WORKER}}})",
                "{{worker}} accept rate",
            ),
            width=6,
        )
    )

    board.row("Prefix cache: gateway against engine")
    board.panel(
        timeseries(
            "Cache hit rate: router's prediction against engine-reported",
            "The router's predicted hit (prompt characters it expected cached on the worker it chose), "
            "the cached share of prompt tokens in the engines' answers (usage), and the engines' own "
            "counters. The prediction far above the engine's figures: the router's view of the caches "
            "is stale (evictions it does not see).",
            "percentunit",
            Query("radixgate:routing_predicted_cache_hit:ratio_rate5m", "gateway: router's prediction"),
            Query("radixgate:cached_prompt_tokens:ratio_rate5m", "engine, in answers' usage"),
            Query(
                f"sum(rate(sglang:cached_tokens_total{{{INSTANCE}}}[{RATE}]))\n"
                f"/ sum(rate(sglang:prompt_tokens_total{{{INSTANCE}}}[{RATE}]))",
                "engine, /metrics counters",
            ),
            max_val=1,
        )
    )
    board.panel(
        timeseries(
            "Engine cache hit rate per worker",
            "Each engine's prefix-cache hit rate gauge (sglang:cache_hit_rate).",
            "percentunit",
            Query(f"avg by (instance) (sglang:cache_hit_rate{{{INSTANCE}}})", "{{instance}}"),
            max_val=1,
        )
    )
    return board
