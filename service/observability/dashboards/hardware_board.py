"""The hardware dashboard (``radixgate-hardware``): SGLang's engine series beside NVIDIA's DCGM exporter's
GPU counters, one row per resource, so that a tail-latency spike can be put on compute, memory bandwidth,
memory capacity or the network.

How the rows tell the causes apart (each panel's description says it too):

- compute (prefill): SM and tensor-pipe activity near 1 while uncached prompt tokens/s and the engine's
  TTFT rise, DRAM activity not saturated;
- memory bandwidth (decode): DRAM activity near 1 while inter-token latency rises with the running batch,
  SM activity below its peak (decode reads every weight and the KV cache for each token);
- memory capacity: framebuffer full and the KV pool above 0.95 with retractions;
- network: the gateway's TTFT above the engine's own (time between the gateway and the engine: network,
  connection, the gateway's queue), or NVLink/PCIe throughput at the link's limit (tensor-parallel
  all-reduce, host transfers) while compute and DRAM are idle.

DCGM series (dcgm-exporter, ``Hostname`` and ``gpu`` labels) are gauges sampled by the exporter; the
profiling ones (``DCGM_FI_PROF_*``) are ratios of cycles (0-1) or bytes per second. ``SM_ACTIVE`` and the
NVLink byte counters are not in dcgm-exporter's default counter list: they need their lines in the CSV
given to ``-f`` (docs/observability.md, Dashboards).
"""

from __future__ import annotations

from service.observability.dashboards.kit import (
    RATE,
    TOKENS_PER_S,
    Board,
    Query,
    label_variable,
    timeseries,
)

GPU = 'Hostname=~"$host", gpu=~"$gpu"'
INSTANCE = 'instance=~"$instance"'
GPU_LEGEND = "{{Hostname}} GPU {{gpu}}"


def _gpu(metric: str) -> Query:
    return Query(f"{metric}{{{GPU}}}", GPU_LEGEND)


def build() -> Board:
    """The hardware dashboard."""
    board = (
        Board(
            "radixgate-hardware",
            "radixgate / hardware",
            "SGLang engine series beside DCGM GPU counters, a row per resource: compute (prefill), memory "
            "bandwidth (decode), memory capacity, interconnect and network.",
        )
        .variable(
            label_variable(
                "instance",
                "instance",
                "sglang:num_running_reqs",
                "Engine",
                "SGLang workers by scrape target.",
            )
        )
        .variable(
            label_variable(
                "host", "Hostname", "DCGM_FI_DEV_FB_USED", "GPU host", "Hosts of the DCGM exporters."
            )
        )
        .variable(
            label_variable(
                "gpu", "gpu", 'DCGM_FI_DEV_FB_USED{Hostname=~"$host"}', "GPU", "GPU index on the host."
            )
        )
    )
    board.row("Compute (prefill): SM and tensor activity")
    board.panel(
        timeseries(
            "SM active",
            "DCGM_FI_PROF_SM_ACTIVE: share of cycles an SM has at least one warp. Near 1 while the "
            "engine's TTFT and uncached prompt tokens/s rise, with DRAM activity below its ceiling: "
            "prefill is compute bound. Needs the field in dcgm-exporter's counters CSV.",
            "percentunit",
            _gpu("DCGM_FI_PROF_SM_ACTIVE"),
            width=6,
            max_val=1,
        )
    )
    board.panel(
        timeseries(
            "Tensor pipe active",
            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE: share of cycles the tensor (HMMA) pipe is busy: the "
            "matrix-multiply work of prefill. High with SM active high: compute saturation.",
            "percentunit",
            _gpu("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"),
            width=6,
            max_val=1,
        )
    )
    board.panel(
        timeseries(
            "Engine TTFT P99",
            "99th percentile time to first token inside each engine (sglang:time_to_first_token_seconds): "
            "its queue and prefill, no network. Rising with SM active near 1: compute.",
            "s",
            Query(
                "histogram_quantile(0.99, sum by (instance, le) "
                f"(rate(sglang:time_to_first_token_seconds_bucket{{{INSTANCE}}}[{RATE}])))",
                "{{instance}}",
            ),
            width=6,
        )
    )
    board.panel(
        timeseries(
            "Uncached prompt tokens per second",
            "Prompt tokens each engine had to prefill (prompt minus prefix-cache hits) per second: the "
            "compute demand. A jump with a falling cache hit rate: a hot-spot of new prompts.",
            TOKENS_PER_S,
            Query(
                f"sum by (instance) (rate(sglang:prompt_tokens_total{{{INSTANCE}}}[{RATE}]))\n"
                f"- sum by (instance) (rate(sglang:cached_tokens_total{{{INSTANCE}}}[{RATE}]))",
                "{{instance}}",
            ),
            width=6,
        )
    )

    board.row("Memory bandwidth (decode): DRAM activity")
    board.panel(
        timeseries(
            "DRAM active",
            "DCGM_FI_PROF_DRAM_ACTIVE: share of cycles the device-memory interface sends or receives "
            "data. Near 1 while inter-token latency rises with the batch and SM active stays below its "
            "peak: decode is memory-bandwidth bound (every token reads the weights and the KV cache).",
            "percentunit",
            _gpu("DCGM_FI_PROF_DRAM_ACTIVE"),
            width=6,
            max_val=1,
        )
    )
    board.panel(
        timeseries(
            "Engine inter-token latency",
            "P50 and P99 time between tokens inside each engine (sglang:inter_token_latency_seconds). "
            "Rising with DRAM active near 1: memory bandwidth; rising with retractions: KV capacity.",
            "s",
            *(
                Query(
                    f"histogram_quantile({q}, sum by (instance, le) "
                    f"(rate(sglang:inter_token_latency_seconds_bucket{{{INSTANCE}}}[{RATE}])))",
                    f"p{round(q * 100)} {{{{instance}}}}",
                )
                for q in (0.5, 0.99)
            ),
            width=6,
        )
    )
    board.panel(
        timeseries(
            "Running batch",
            "Requests in each engine's running batch (sglang:num_running_reqs). Decode time per step "
            "grows with the batch once DRAM bandwidth is the limit.",
            "short",
            Query(f"sum by (instance) (sglang:num_running_reqs{{{INSTANCE}}})", "{{instance}}"),
            width=6,
        )
    )
    board.panel(
        timeseries(
            "Generation throughput",
            "Tokens each engine generates per second. Flat while the batch grows: the bandwidth ceiling.",
            TOKENS_PER_S,
            Query(f"sum by (instance) (sglang:gen_throughput{{{INSTANCE}}})", "{{instance}}"),
            width=6,
        )
    )

    board.row("Memory capacity: framebuffer and KV pool")
    board.panel(
        timeseries(
            "Framebuffer used",
            "DCGM_FI_DEV_FB_USED, MiB: device memory in use (SGLang reserves most of it for the KV pool "
            "at start, so it stays high; a change means another process or a restart).",
            "mbytes",
            _gpu("DCGM_FI_DEV_FB_USED"),
            width=6,
        )
    )
    board.panel(
        timeseries(
            "Framebuffer used share",
            "DCGM_FI_DEV_FB_USED / (FB_USED + DCGM_FI_DEV_FB_FREE).",
            "percentunit",
            Query(
                f"DCGM_FI_DEV_FB_USED{{{GPU}}}\n"
                f"/ (DCGM_FI_DEV_FB_USED{{{GPU}}} + DCGM_FI_DEV_FB_FREE{{{GPU}}})",
                GPU_LEGEND,
            ),
            width=6,
            max_val=1,
        )
    )
    board.panel(
        timeseries(
            "KV pool used",
            "Used share of each engine's KV pool (sglang:token_usage). Full, with retractions beside it: "
            "a capacity limit, not bandwidth.",
            "percentunit",
            Query(f"max by (instance) (sglang:token_usage{{{INSTANCE}}})", "{{instance}}"),
            width=6,
            max_val=1,
        )
    )
    board.panel(
        timeseries(
            "Retractions",
            "Running requests each engine retracted per second for want of KV space (they restart their "
            "prefill later: TTFT and TPOT both rise).",
            "reqps",
            Query(
                f"sum by (instance) (rate(sglang:num_retracted_requests_total{{{INSTANCE}}}[{RATE}]))",
                "{{instance}}",
            ),
            width=6,
        )
    )

    board.row("Interconnect and network")
    board.panel(
        timeseries(
            "NVLink throughput",
            "DCGM_FI_PROF_NVLINK_TX_BYTES and RX_BYTES, bytes per second (payload): tensor-parallel "
            "all-reduce between the GPUs of one engine. At the link's limit while SM and DRAM activity "
            "are idle: the interconnect is the bottleneck. Needs the fields in dcgm-exporter's CSV.",
            "Bps",
            Query(f"DCGM_FI_PROF_NVLINK_TX_BYTES{{{GPU}}}", f"tx {GPU_LEGEND}"),
            Query(f"DCGM_FI_PROF_NVLINK_RX_BYTES{{{GPU}}}", f"rx {GPU_LEGEND}"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "PCIe throughput",
            "DCGM_FI_PROF_PCIE_TX_BYTES and RX_BYTES, bytes per second (headers included): transfers "
            "between host and GPU (inputs, outputs, KV offload).",
            "Bps",
            Query(f"DCGM_FI_PROF_PCIE_TX_BYTES{{{GPU}}}", f"tx {GPU_LEGEND}"),
            Query(f"DCGM_FI_PROF_PCIE_RX_BYTES{{{GPU}}}", f"rx {GPU_LEGEND}"),
            width=8,
        )
    )
    board.panel(
        timeseries(
            "Gateway TTFT against engine TTFT (mean)",
            "Mean time to first token as the gateway measures it (every class and model) and as the "
            "engines measure it, and their difference: the time between the gateway and the engine "
            "(gateway queue, network, connection). A growing difference with steady engine TTFT: the "
            "cause is not the GPU.",
            "s",
            Query(
                f"sum(rate(radixgate_class_ttft_seconds_sum[{RATE}]))\n"
                f"/ sum(rate(radixgate_class_ttft_seconds_count[{RATE}]))",
                "gateway",
            ),
            Query(
                f"sum(rate(sglang:time_to_first_token_seconds_sum{{{INSTANCE}}}[{RATE}]))\n"
                f"/ sum(rate(sglang:time_to_first_token_seconds_count{{{INSTANCE}}}[{RATE}]))",
                "engine",
            ),
            Query(
                f"sum(rate(radixgate_class_ttft_seconds_sum[{RATE}]))\n"
                f"/ sum(rate(radixgate_class_ttft_seconds_count[{RATE}]))\n"
                f"- sum(rate(sglang:time_to_first_token_seconds_sum{{{INSTANCE}}}[{RATE}]))\n"
                f"/ sum(rate(sglang:time_to_first_token_seconds_count{{{INSTANCE}}}[{RATE}]))",
                "gateway - engine",
            ),
            width=8,
        )
    )
    return board
