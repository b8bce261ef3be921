"""Step-time profiles of the simulated SGLang worker, each calibrated to cited figures.

The simulator's step-time model (all times in milliseconds, sizes in tokens):

- a *prefill* (extend) step over ``n`` new, uncached prompt tokens takes
  ``step_base_ms + prefill_ms_per_token * n``;
- a *decode* step over a batch of ``b`` running requests whose contexts hold ``k`` tokens in all takes
  ``step_base_ms + decode_ms_per_seq * b + decode_ms_per_kv_token * k``;
- every request waits ``ttft_floor_ms`` (HTTP, tokenization, scheduler pick-up) before it can be scheduled;
- each step's duration is multiplied by ``1 + step_jitter * u``, ``u`` uniform in [-1, 1] (seeded).

The base term is the cost of reading the weights once per forward pass (memory-bound decode) plus launch
overhead; the per-sequence term is the batch-proportional part of the GEMMs and sampling; the per-KV-token
term is attention reading the KV cache. Attention's quadratic cost inside prefill is ignored (prompts of a
few thousand tokens at most).

Every profile lists its anchors: published (or here-measured) figures with the benchmark shape they were
measured at and the tolerance the simulation must meet (``tests/loadgen/test_sim_profiles.py`` re-runs each
anchor
through :func:`loadgen.sim.calibrate.run_closed_loop`). Where no figure exists the parameter is marked as an
assumption in ``notes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AnchorMetric = Literal["ttft_ms", "itl_ms", "output_tok_s", "e2e_s"]

NIM_BENCH = (
    "NVIDIA NIM for LLMs benchmarking guide, 'Performance' page (docs.nvidia.com/nim/benchmarking/llm/"
    "1.0.0/performance), table '{model}', NIM version 1.3.0, concurrency {c}"
)


@dataclass(frozen=True, slots=True)
class Anchor:
    """One figure a profile must reproduce.

    Attributes:
        metric: ``ttft_ms`` (mean time to first token, ms), ``itl_ms`` (mean inter-token latency, ms),
            ``output_tok_s`` (output tokens/s over the run), ``e2e_s`` (mean request latency, s).
        value: the figure.
        tolerance: allowed relative error of the simulation (0.15 = ±15 %).
        concurrency: clients: closed loop (each sends its next request when its previous one ends), or
            one burst of that many requests at once when ``burst``.
        input_tokens, output_tokens: request shape (tokens).
        source: where the figure comes from.
    """

    metric: AnchorMetric
    value: float
    tolerance: float
    concurrency: int
    input_tokens: int
    output_tokens: int
    source: str
    burst: bool = False


@dataclass(frozen=True, slots=True)
class SimProfile:
    """Parameters of the step-time model for one model on one machine (see the module docstring).

    Attributes:
        name: profile id used on the command line.
        model: model served (also the default ``/v1/models`` id).
        hardware: GPUs/CPUs and tensor-parallel size, in words.
        tp: tensor-parallel size.
        step_base_ms: fixed cost of any forward pass (ms).
        prefill_ms_per_token: cost of each new (uncached) prompt token in a prefill step (ms).
        decode_ms_per_seq: cost of each running request in a decode step (ms).
        decode_ms_per_kv_token: cost of each context token attended to in a decode step (ms).
        ttft_floor_ms: delay before a new request can be scheduled (ms).
        kv_capacity_tokens: KV cache pool (SGLang's ``max_total_num_tokens``), tokens.
        max_running_requests: most requests decoding at once (``--max-running-requests``).
        chunked_prefill_tokens: most prompt tokens in one prefill step (``--chunked-prefill-size``).
        context_length: longest prompt + output accepted (tokens).
        mixed_chunk: prefill chunks ride in the decode step (``--enable-mixed-chunk``) instead of
            pausing decoding for a prefill-only step.
        new_token_ratio: share of each request's remaining ``max_new_tokens`` reserved in the KV pool at
            admission (SGLang's ``new_token_ratio``; fixed here, SGLang decays it from 0.7).
        step_jitter: relative spread of step durations (seeded).
        anchors: figures the profile reproduces.
        notes: calibration method and assumptions.
    """

    name: str
    model: str
    hardware: str
    tp: int
    step_base_ms: float
    prefill_ms_per_token: float
    decode_ms_per_seq: float
    decode_ms_per_kv_token: float
    ttft_floor_ms: float
    kv_capacity_tokens: int
    max_running_requests: int
    chunked_prefill_tokens: int
    context_length: int
    mixed_chunk: bool
    new_token_ratio: float
    step_jitter: float
    anchors: tuple[Anchor, ...]
    notes: str

    def prefill_step_ms(self, new_tokens: int) -> float:
        """Duration of a prefill step over ``new_tokens`` uncached tokens (ms, before jitter)."""
        return self.step_base_ms + self.prefill_ms_per_token * new_tokens

    def decode_step_ms(self, batch: int, kv_tokens: int) -> float:
        """Duration of a decode step for ``batch`` requests holding ``kv_tokens`` context tokens (ms)."""
        return self.step_base_ms + self.decode_ms_per_seq * batch + self.decode_ms_per_kv_token * kv_tokens


_HERE = "shared/notes/sglang-on-cpu.md (SGLang 0.5.23 CPU worker measured on this machine kind): "


def _nim(model: str, c: int) -> str:
    return NIM_BENCH.format(model=model, c=c) + "; input 200 / output 200 tokens (assumed, see notes)"


_NIM_NOTE = (
    "The NIM tables' headers (GPU count, precision, input/output lengths) are not in the stored copy that "
    "was read; 200 input / 200 output tokens is derived from the table itself: at concurrency 100, "
    "c·OSL / (TTFT + (OSL − 1)·ITL) equals the published throughput only for OSL ≈ 200 (8B: 205, 70B: 203). "
    "NIM serves these with TensorRT-LLM (assumed) and in-flight batching, so mixed_chunk is on (SGLang "
    "--enable-mixed-chunk). Fit: step_base ≈ ITL at concurrency 1; the per-request slope of ITL over "
    "concurrency is split into prefill (from TTFT at concurrency 1), per-KV-token (HBM bandwidth: KV bytes "
    "per token / 3.35 TB/s) and per-sequence, set so that the simulated closed-loop ITL "
    "follows the table's slope (python -m loadgen.sim.calibrate). A linear step model cannot "
    "follow the table's saturation above concurrency ~150 (8B): there the simulator is optimistic."
)

LLAMA_8B_H100 = SimProfile(
    name="llama-3.1-8b-h100",
    model="meta-llama/Llama-3.1-8B-Instruct",
    hardware="1x H100 SXM 80GB, TP 1",
    tp=1,
    step_base_ms=4.32,
    prefill_ms_per_token=0.0183,
    decode_ms_per_seq=0.027,
    decode_ms_per_kv_token=0.000039,
    ttft_floor_ms=1.0,
    kv_capacity_tokens=400_000,
    max_running_requests=256,
    chunked_prefill_tokens=8192,
    context_length=131_072,
    mixed_chunk=True,
    new_token_ratio=0.4,
    step_jitter=0.02,
    anchors=(
        Anchor("itl_ms", 4.37, 0.10, 1, 200, 200, _nim("Llama-3.1-8b-instruct", 1)),
        Anchor("ttft_ms", 8.98, 0.15, 1, 200, 200, _nim("Llama-3.1-8b-instruct", 1)),
        Anchor("output_tok_s", 227.44, 0.10, 1, 200, 200, _nim("Llama-3.1-8b-instruct", 1)),
        Anchor("itl_ms", 6.02, 0.15, 25, 200, 200, _nim("Llama-3.1-8b-instruct", 25)),
        Anchor("itl_ms", 7.19, 0.15, 50, 200, 200, _nim("Llama-3.1-8b-instruct", 50)),
        Anchor("itl_ms", 8.62, 0.15, 100, 200, 200, _nim("Llama-3.1-8b-instruct", 100)),
        Anchor("output_tok_s", 10369.56, 0.15, 100, 200, 200, _nim("Llama-3.1-8b-instruct", 100)),
    ),
    notes=_NIM_NOTE
    + " Assumed (no figure): KV pool 400k tokens = (0.85 x 80 GB − 16 GB BF16 weights) / 128 KiB of "
    "BF16 KV per token (32 layers x 8 KV heads x 128 x 2 x 2 B); max_running_requests 256; "
    "chunked prefill 8192 (SGLang's H100 default); step jitter 2 %. ITL 4.37 ms at concurrency 1 is below "
    "the BF16 weight-read floor (16 GB / 3.35 TB/s = 4.8 ms), so the cited figures are FP8-weight figures.",
)

LLAMA_70B_H100_TP8 = SimProfile(
    name="llama-3.1-70b-h100-tp8",
    model="meta-llama/Llama-3.1-70B-Instruct",
    hardware="8x H100 SXM 80GB (NVLink), TP 8",
    tp=8,
    step_base_ms=12.9,
    prefill_ms_per_token=0.053,
    decode_ms_per_seq=0.063,
    decode_ms_per_kv_token=0.000012,
    ttft_floor_ms=1.5,
    kv_capacity_tokens=1_200_000,
    max_running_requests=512,
    chunked_prefill_tokens=8192,
    context_length=131_072,
    mixed_chunk=True,
    new_token_ratio=0.4,
    step_jitter=0.02,
    anchors=(
        Anchor("itl_ms", 13.21, 0.10, 1, 200, 200, _nim("Llama-3.1-70b-instruct", 1)),
        Anchor("ttft_ms", 25.05, 0.15, 1, 200, 200, _nim("Llama-3.1-70b-instruct", 1)),
        Anchor("output_tok_s", 75.36, 0.10, 1, 200, 200, _nim("Llama-3.1-70b-instruct", 1)),
        Anchor("itl_ms", 15.31, 0.15, 25, 200, 200, _nim("Llama-3.1-70b-instruct", 25)),
        Anchor("itl_ms", 23.28, 0.15, 100, 200, 200, _nim("Llama-3.1-70b-instruct", 100)),
        Anchor("output_tok_s", 4092.34, 0.15, 100, 200, 200, _nim("Llama-3.1-70b-instruct", 100)),
        Anchor("itl_ms", 35.25, 0.15, 250, 200, 200, _nim("Llama-3.1-70b-instruct", 250)),
        Anchor("output_tok_s", 6429.95, 0.15, 250, 200, 200, _nim("Llama-3.1-70b-instruct", 250)),
    ),
    notes=_NIM_NOTE
    + " The table's tensor-parallel size is assumed to be 8 (ITL 13.2 ms at concurrency 1 against 18.6 ms "
    "for Llama-3.3-70B on 2x H100 FP8 TP2 on the same page). Assumed (no figure): KV pool 1.2M tokens = "
    "(0.85 x 80 GB − 17.5 GB of BF16 weights per GPU) / 40 KiB of KV per token per GPU (80 layers x 1 KV "
    "head per GPU x 128 x 2 x 2 B); max_running_requests 512; chunked prefill 8192; jitter 2 %.",
)

SMOLLM2_CPU = SimProfile(
    name="smollm2-135m-cpu2",
    model="SmolLM2-135M-Instruct",
    hardware="2 CPU cores (Sapphire Rapids, AVX-512/AMX), SGLang 0.5.23 CPU, float32, TP 1",
    tp=1,
    step_base_ms=49.0,
    prefill_ms_per_token=0.46,
    decode_ms_per_seq=2.16,
    decode_ms_per_kv_token=0.0005,
    ttft_floor_ms=10.0,
    kv_capacity_tokens=20_000,
    max_running_requests=64,
    chunked_prefill_tokens=2048,
    context_length=8192,
    mixed_chunk=False,
    new_token_ratio=0.4,
    step_jitter=0.03,
    anchors=(
        Anchor("ttft_ms", 76.5, 0.12, 1, 40, 32, _HERE + "TTFT 68-85 ms", burst=True),
        Anchor("e2e_s", 1.7, 0.07, 1, 40, 32, _HERE + "one request of 32 tokens 1.6-1.8 s", burst=True),
        Anchor("e2e_s", 2.4, 0.06, 10, 40, 32, _HERE + "10 concurrent x 32 tokens 2.3-2.5 s", burst=True),
        Anchor("output_tok_s", 135.0, 0.10, 10, 40, 32, _HERE + "10 concurrent: ~135 tok/s", burst=True),
    ),
    notes="Measured on this project's CPU machines (shared/notes/sglang-on-cpu.md, 'What it does here'); "
    "SGLang's default scheduler (no mixed chunk). Fit: TTFT = floor + base + prefill x prompt; one request "
    "= TTFT + 31 decode steps at batch 1; the burst of 10 = one prefill step of 10 prompts + 31 decode "
    "steps at batch 10. Assumed: prompts of ~40 tokens (the note gives no prompt length), TTFT floor "
    "10 ms, KV pool 20k tokens, max_running_requests 64, chunked prefill 2048, jitter 3 %.",
)

PROFILES: dict[str, SimProfile] = {p.name: p for p in (LLAMA_8B_H100, LLAMA_70B_H100_TP8, SMOLLM2_CPU)}


def get_profile(name: str) -> SimProfile:
    """The profile called ``name``.

    Raises:
        KeyError: unknown name (the message lists the known ones).
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
