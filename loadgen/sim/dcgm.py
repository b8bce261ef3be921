"""DCGM-style GPU gauges that the simulated worker's step model implies: a documented simulation, not a
measurement (no GPU runs here).

A real deployment reads these from NVIDIA's dcgm-exporter beside each SGLang worker; the simulator exports
the same names and labels (dcgm-exporter 4.5.3-4.8.2, ``deploy/prometheus/external_series.txt``) on its own
``/metrics`` when asked (``--dcgm``), so that dashboards, alerts and ``python -m service diagnose`` can be
exercised against a GPU-shaped signal:

- ``DCGM_FI_PROF_SM_ACTIVE`` and ``DCGM_FI_PROF_DRAM_ACTIVE`` (ratios of cycles, 0-1): averaged over the
  last :data:`ACTIVITY_WINDOW_S` s of the engine's steps (:attr:`loadgen.sim.engine.SimEngine.steps`), each
  step's time split into its prefill part and its decode part (:class:`loadgen.sim.engine.StepRecord`):

  - prefill time (compute-bound GEMMs over many tokens): SM active :data:`PREFILL_SM`, DRAM active
    :data:`PREFILL_DRAM`;
  - decode time (memory-bound: the weights and the KV cache are read once per step for a few tokens):
    SM active :data:`DECODE_SM`, DRAM active :data:`DECODE_DRAM`;
  - a slowed part (the knobs' ``prefill_factor`` / ``decode_factor``): the extra prefill time is compute
    (SM clocks or a neighbour's kernels: warps stay resident, the memory interface does no more work, so
    DRAM activity falls), the extra decode time is memory (lost HBM bandwidth: the interface is busy all
    of it, DRAM activity 1);
  - idle time: 0.

  The four ratios are assumptions in the range NVIDIA's profiling guide and published decode/prefill
  roofline studies give for dense transformers (prefill near the compute roof, decode near the memory
  roof); they are not calibrated to a measurement.
- ``DCGM_FI_DEV_FB_USED`` / ``DCGM_FI_DEV_FB_FREE`` (MiB): constant, as on an SGLang GPU, which allocates
  its KV pool at start (``--mem-fraction-static``): the weights' share on each GPU + the profile's KV pool
  + :data:`RUNTIME_MIB` (CUDA context, activations, CUDA graphs).
- ``DCGM_FI_PROF_NVLINK_TX_BYTES`` / ``RX_BYTES`` (bytes/s): tensor-parallel all-reduce traffic: two
  all-reduces per layer of ``hidden`` BF16 values per token, a ring all-reduce sending ``2 (tp - 1) / tp``
  of the data from each GPU; 0 with TP 1.

Only the GPU profiles have GPU facts (:data:`GPU_FACTS`); a CPU profile exports no DCGM series.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from loadgen.sim.engine import StepRecord

ACTIVITY_WINDOW_S = 1.0
"""The span the activity ratios average over, s of the engine's clock (dcgm-exporter's default collection
interval is of this order)."""

PREFILL_SM, PREFILL_DRAM = 0.95, 0.35
"""Activity during prefill time (assumed): SMs nearly always busy, memory interface a third of the time."""

DECODE_SM, DECODE_DRAM = 0.6, 0.8
"""Activity during decode time (assumed): GEMV kernels leave SMs idle part of the time, memory busy."""

RUNTIME_MIB = 2048
"""Device memory besides weights and KV pool (CUDA context, activations, CUDA graphs), MiB (assumed)."""

BF16_BYTES = 2


@dataclass(frozen=True, slots=True)
class GpuFacts:
    """What the gauges need of a profile's GPUs and model.

    Attributes:
        name: the GPU model (``modelName`` label).
        memory_mib: device memory of one GPU, MiB.
        weights_mib: weights held by one GPU, MiB.
        kv_bytes_per_token: KV cache of one token on one GPU, bytes.
        layers, hidden: the model's layer count and hidden size (all-reduce traffic).
    """

    name: str
    memory_mib: int
    weights_mib: int
    kv_bytes_per_token: int
    layers: int
    hidden: int


H100_MIB = 81_559  # NVIDIA H100 SXM 80GB as nvidia-smi reports it

GPU_FACTS: dict[str, GpuFacts] = {
    # the profiles' notes: 16 GB of BF16 weights, 128 KiB of BF16 KV per token (32 layers x 8 KV heads
    # x 128 x 2 x 2 B); Llama-3.1-8B: hidden 4096
    "llama-3.1-8b-h100": GpuFacts("NVIDIA H100 80GB HBM3", H100_MIB, 15_259, 131_072, 32, 4096),
    # 17.5 GB of BF16 weights per GPU, 40 KiB of KV per token per GPU; Llama-3.1-70B: 80 layers, hidden 8192
    "llama-3.1-70b-h100-tp8": GpuFacts("NVIDIA H100 80GB HBM3", H100_MIB, 16_689, 40_960, 80, 8192),
}


@dataclass(frozen=True, slots=True)
class Activity:
    """The GPU activity over a span: ``sm`` and ``dram`` (ratios of cycles, 0-1), ``tokens_per_s``."""

    sm: float
    dram: float
    tokens_per_s: float


def activity(steps: Iterable[StepRecord], now_s: float, window_s: float = ACTIVITY_WINDOW_S) -> Activity:
    """The activity over ``[now_s - window_s, now_s]`` of the engine's ``steps`` (see the module docstring).

    Each step counts by the share of its span inside the window; its time is split into prefill and decode
    parts in the ratio of its slowed nominal costs.
    """
    start = now_s - window_s
    sm = dram = tokens = 0.0
    for step in steps:
        span = step.end_s - step.start_s
        inside = min(step.end_s, now_s) - max(step.start_s, start)
        if span <= 0 or inside <= 0:
            continue
        share = inside / span
        pf, df = step.prefill_factor, step.decode_factor
        slowed = step.prefill_ms * pf + step.decode_ms * df
        if slowed <= 0:
            continue
        scale = span * share / slowed  # s of window time per slowed ms
        prefill_s = step.prefill_ms * pf * scale
        decode_s = step.decode_ms * df * scale
        decode_nominal_s = step.decode_ms * scale
        sm += PREFILL_SM * prefill_s + DECODE_SM * decode_s
        dram += PREFILL_DRAM * step.prefill_ms * scale  # a slowed prefill moves no more bytes
        dram += DECODE_DRAM * decode_nominal_s + (decode_s - decode_nominal_s)  # lost bandwidth: busy
        tokens += step.tokens * share
    return Activity(min(1.0, sm / window_s), min(1.0, dram / window_s), tokens / window_s)


def nvlink_bytes_per_token(facts: GpuFacts, tp: int) -> float:
    """Bytes each GPU sends (and receives) over NVLink per token computed: two ring all-reduces per layer
    of ``hidden`` BF16 values, ``2 (tp - 1) / tp`` of them per GPU; 0 with ``tp`` 1."""
    if tp <= 1:
        return 0.0
    return 2 * facts.layers * facts.hidden * BF16_BYTES * 2 * (tp - 1) / tp


class DcgmGauges:
    """The DCGM-style gauges of one simulated worker, on a registry of their own.

    Args:
        facts: its GPUs. tp: how many (one series per GPU, labelled ``gpu`` 0..tp-1).
        kv_pool_tokens: the KV pool, tokens (each GPU holds its share of every token: ``kv_bytes_per_token``
            is per GPU).
        hostname: the ``Hostname`` label.
    """

    def __init__(self, facts: GpuFacts, tp: int, kv_pool_tokens: int, hostname: str) -> None:
        self.facts = facts
        self.tp = tp
        self.registry = CollectorRegistry()
        labels = ["gpu", "UUID", "device", "modelName", "Hostname"]
        self._labels = [
            [str(i), f"GPU-sim-{hostname}-{i}", f"nvidia{i}", facts.name, hostname] for i in range(tp)
        ]
        r = self.registry
        self.sm = Gauge(
            "DCGM_FI_PROF_SM_ACTIVE", "Ratio of cycles an SM has a warp (simulated).", labels, registry=r
        )
        self.dram = Gauge(
            "DCGM_FI_PROF_DRAM_ACTIVE", "Ratio of cycles the memory interface is busy (simulated).", labels,
            registry=r,
        )  # fmt: skip
        self.fb_used = Gauge("DCGM_FI_DEV_FB_USED", "Framebuffer used, MiB (simulated).", labels, registry=r)
        self.fb_free = Gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer free, MiB (simulated).", labels, registry=r)
        self.nvlink_tx = Gauge(
            "DCGM_FI_PROF_NVLINK_TX_BYTES", "NVLink transmit, bytes/s (simulated).", labels, registry=r
        )
        self.nvlink_rx = Gauge(
            "DCGM_FI_PROF_NVLINK_RX_BYTES", "NVLink receive, bytes/s (simulated).", labels, registry=r
        )
        kv_mib = kv_pool_tokens * facts.kv_bytes_per_token / 2**20  # every GPU holds every token's shard
        self.used_mib = min(facts.memory_mib, round(facts.weights_mib + kv_mib + RUNTIME_MIB))

    def render(self, steps: Iterable[StepRecord], now_s: float) -> bytes:
        """The gauges set from the engine's ``steps`` at ``now_s``; their text exposition."""
        act = activity(steps, now_s)
        link = act.tokens_per_s * nvlink_bytes_per_token(self.facts, self.tp)
        for values in self._labels:
            self.sm.labels(*values).set(act.sm)
            self.dram.labels(*values).set(act.dram)
            self.fb_used.labels(*values).set(self.used_mib)
            self.fb_free.labels(*values).set(self.facts.memory_mib - self.used_mib)
            self.nvlink_tx.labels(*values).set(link)
            self.nvlink_rx.labels(*values).set(link)
        return generate_latest(self.registry)
