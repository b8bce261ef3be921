"""Two models behind one gateway: the CPU SGLang worker (SmolLM2) and a simulated Llama-3.1-8B worker.

Run by ``make up-two-models`` (with ``--keep``; see docs/models.md). Steps:
1. write a stub tokenizer for the simulated model (word-level, ChatML: ``loadgen.bench.stub_tokenizer``,
   which counts what the simulator counts) and start the simulated worker (``python -m loadgen.sim
   --profile llama-3.1-8b-h100 --model-name sim-llama-3.1-8b``, a simulator, not a model: made-up words
   at an H100's speed),
2. start Redis and the gateway with ``RADIXGATE_MODELS`` naming both models (:func:`models_setting`): the
   gateway launches the SmolLM2 CPU worker itself; each model has its own interactive goal (SmolLM2:
   2,000 ms, sized for the CPU; sim-llama-3.1-8b: 500 ms),
3. list ``/v1/models``, send one chat to each model (its answer, usage and the gateway's token count), show
   each worker's model on ``/admin/workers``,
4. stop everything (unless ``--keep``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from loadgen.bench.stub_tokenizer import write_stub_model
from loadgen.stack import (
    CPU_PRIORITY_CLASSES,
    LocalStack,
    StackError,
    free_port,
    terminate_as_exit,
    wait_until_stopped,
)
from service.config.engine import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / ".run" / "two-models"
SIM_MODEL = "sim-llama-3.1-8b"
QUESTION = [{"role": "user", "content": "In one sentence: what does a gateway in front of two models do?"}]


def models_setting(sim_url: str, sim_tokenizer: Path) -> str:
    """``RADIXGATE_MODELS``: the launched CPU worker's model (its tokenizer is the engine's model folder,
    its workers the launched ones) and the simulated one, with their own goals and switches."""
    return json.dumps(
        [
            {
                "id": DEFAULT_MODEL,
                "aliases": ["smollm2"],
                "priority_classes": {"interactive": {"ttft_goal_ms": 2000, "queue_wait_budget_ms": 2000}},
            },
            {
                "id": SIM_MODEL,
                "aliases": ["llama"],
                "workers": [sim_url],
                "tokenizer_path": str(sim_tokenizer),
                "owned_by": "simulator",
                "tools": False,
                "structured_outputs": False,
                "priority_classes": {"interactive": {"ttft_goal_ms": 500, "queue_wait_budget_ms": 500}},
            },
        ]
    )


def start_sim(port: int) -> subprocess.Popen[bytes]:
    """The simulated worker, its output in the run folder."""
    log = open(RUN / "sim-worker.log", "wb")  # noqa: SIM115 - owned by the child process
    argv = [sys.executable, "-m", "loadgen.sim", "--profile", "llama-3.1-8b-h100"]
    argv += ["--model-name", SIM_MODEL, "--port", str(port)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the simulated worker exited with {proc.returncode}; see {RUN}/sim-worker.log")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.terminate()
    sys.exit(f"the simulated worker did not answer in 30 s; see {RUN}/sim-worker.log")


def run_requests(stack: LocalStack) -> None:
    key = stack.create_tenant(
        "acme", name="Acme Corp", priority_class="interactive", quotas={"requests_per_min": 600}
    )
    auth = {"Authorization": f"Bearer {key}"}
    print("\n== 1. GET /v1/models")
    for m in httpx.get(f"{stack.url}/v1/models", headers=auth, timeout=10).json()["data"]:
        print(
            f"  {m['id']:<24} root={m['root']:<22} owned_by={m['owned_by']:<10} "
            f"context_length={m['context_length']:<7} capabilities={m['capabilities']}"
        )
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=4)
    print("\n== 2. one chat to each model (each counted with its own tokenizer and template)")
    for model in (DEFAULT_MODEL, SIM_MODEL):
        t0 = time.perf_counter()
        resp = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)  # type: ignore[arg-type]
        usage = resp.usage
        assert usage is not None
        print(f"  [{model}] {resp.choices[0].message.content!r}")
        print(
            f"      usage: prompt={usage.prompt_tokens} completion={usage.completion_tokens} "
            f"({time.perf_counter() - t0:.2f} s)"
        )
    print("\n== 3. each worker and its model (GET /admin/workers)")
    with stack.admin() as admin:
        for w in admin.get("/admin/workers").json()["data"]:
            print(
                f"  {w['url']:<26} model={w['model']} healthy={w['healthy']} mismatch={w['model_mismatch']}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keep", action="store_true", help="keep the stack running until Ctrl-C")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    args = parser.parse_args()
    RUN.mkdir(parents=True, exist_ok=True)
    tokenizer = write_stub_model(RUN / "sim-llama-tokenizer")
    sim_port = free_port()
    env = {"RADIXGATE_MODELS": models_setting(f"http://127.0.0.1:{sim_port}", tokenizer)}
    if "RADIXGATE_PRIORITY_CLASSES" not in os.environ:
        env["RADIXGATE_PRIORITY_CLASSES"] = CPU_PRIORITY_CLASSES
    print(f"starting a simulated {SIM_MODEL} worker, redis-server, one SGLang CPU worker and the gateway")
    print(f"(logs in {RUN}; the CPU worker needs 20-60 s to load the model)")
    with terminate_as_exit():
        sim = start_sim(sim_port)
        stack = LocalStack(RUN, port=args.port, env=env)
        try:
            try:
                stack.start()
            except StackError as exc:
                sys.exit(str(exc))
            run_requests(stack)
            if args.keep:
                wait_until_stopped(
                    f"\nThe stack keeps running: gateway {stack.url}, admin token {stack.admin_token}\n"
                    f"{stack.runbook_variables()}\nCtrl-C stops it."
                )
        except KeyboardInterrupt:
            print("interrupted")
        finally:
            stack.stop()
            sim.terminate()
            sim.wait(timeout=10)


if __name__ == "__main__":
    main()
