"""The main job: Redis + one CPU SGLang worker + the gateway, then real requests through the gateway.

Run by ``make demo`` (or ``make up`` with ``--keep``). Steps:
1. start ``redis-server`` (a private one on a free port, data in .run/),
2. start the gateway, which launches and supervises one SGLang worker (``RADIXGATE_ENGINE__LAUNCH=true``),
3. create two tenants through the admin API (``acme``: generous quotas; ``tiny``: 2 requests/min),
4. send chat requests with the official ``openai`` client that share a long system prompt (one streamed),
   print the answers and the usage with cached tokens, then show ``tiny`` getting a 429,
5. stop everything (unless ``--keep``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx
import openai

from loadgen.stack import (
    CPU_PRIORITY_CLASSES,
    LocalStack,
    StackError,
    terminate_as_exit,
    wait_until_stopped,
)
from service.config.settings import configured_home

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / ".run"

SYSTEM_PROMPT = (
    "You are the support assistant of Radix Rail, a railway company. Answer in one or two short sentences. "
    "Facts you know: trains leave every 20 minutes from 06:00 to 23:40; a single ticket costs 4 euros, a day "
    "pass 11 euros, a weekly pass 35 euros; children under 6 travel free; bicycles are allowed outside rush "
    "hours (07:00-09:00 and 16:30-18:30); lost items are kept at the central station for 30 days; the "
    "customer line is open on weekdays from 08:00 to 20:00; refunds are possible up to 24 hours before "
    "departure; dogs travel with a reduced ticket of 2 euros; every train has a quiet carriage at the front."
)
QUESTIONS = ["How much is a day pass?", "Can I take my bicycle at 08:15?", "Do dogs need a ticket?"]


def create_tenant(stack: LocalStack, tenant_id: str, **spec: object) -> str:
    api_key = stack.create_tenant(tenant_id, **spec)
    print(f"  tenant {tenant_id!r:8} quotas={spec.get('quotas', {})} key={api_key[:16]}… (shown once)")
    return api_key


def run_requests(stack: LocalStack) -> None:
    base = stack.url
    admin = stack.admin()
    print("\n== 1. tenants, created through the admin API")
    acme_key = create_tenant(
        stack,
        "acme",
        name="Acme Corp",
        priority_class="interactive",
        quotas={"requests_per_min": 600, "tokens_per_min": 200_000},
    )
    tiny_key = create_tenant(
        stack, "tiny", name="Tiny Startup", quotas={"requests_per_min": 2, "tokens_per_min": 20_000}
    )
    model = admin.get("/v1/models", headers={"Authorization": f"Bearer {acme_key}"}).json()["data"][0]["id"]

    # a 503 (shed: the worker is busy, e.g. still warming up on a loaded machine) carries Retry-After,
    # which the client honours on its retries
    acme = openai.OpenAI(base_url=f"{base}/v1", api_key=acme_key, max_retries=4)
    print(f"\n== 2. chat requests from 'acme' to {model}, sharing one system prompt")
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        t0 = time.perf_counter()
        if i == 1:
            print(f"\n[{i + 1}] {question}  (streamed)\n    ", end="", flush=True)
            stream = acme.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=48,
                temperature=0,
                stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True},
            )
            usage = None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    print(chunk.choices[0].delta.content, end="", flush=True)
                usage = chunk.usage or usage
            print()
        else:
            resp = acme.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)  # type: ignore[arg-type]
            print(f"\n[{i + 1}] {question}\n    {resp.choices[0].message.content}")
            usage = resp.usage
        assert usage is not None
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        print(
            f"    usage: prompt={usage.prompt_tokens} completion={usage.completion_tokens} "
            f"cached={cached}  ({time.perf_counter() - t0:.2f} s)"
        )

    print("\n== 3. 'tiny' has 2 requests/min: the third gets 429")
    tiny = openai.OpenAI(base_url=f"{base}/v1", api_key=tiny_key, max_retries=0)
    for i in range(3):
        try:
            r = tiny.chat.completions.create(
                model=model, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Say hi."}]
            )
            print(f"  request {i + 1}: 200 {r.choices[0].message.content!r}")
        except openai.RateLimitError as exc:
            retry_after = exc.response.headers.get("retry-after")
            message = exc.body["message"] if isinstance(exc.body, dict) else exc
            print(f"  request {i + 1}: {exc.status_code} Retry-After={retry_after} s — {message}")

    print("\n== 4. usage per tenant (admin API)")
    for tenant in ("acme", "tiny"):
        u = admin.get(f"/admin/tenants/{tenant}/usage").json()
        print(
            f"  {tenant}: requests={u['requests']} prompt={u['prompt_tokens']} completion="
            f"{u['completion_tokens']} cached={u['cached_tokens']} quota_rejections={u['quota_rejections']}"
        )
    metrics = [
        ln
        for ln in httpx.get(f"{base}/metrics").text.splitlines()
        if ln.startswith(("radixgate_requests_total", "radixgate_cached_tokens_total"))
    ]
    print("\n== 5. a few Prometheus series from /metrics\n  " + "\n  ".join(metrics))


def serve(stack: LocalStack, keep: bool, t0: float) -> None:
    """Send the demo requests; with ``keep``, wait for Ctrl-C; stop the stack in every case."""
    try:
        print(f"gateway ready after {time.monotonic() - t0:.0f} s")
        run_requests(stack)
        if keep:
            wait_until_stopped(
                f"\nThe stack keeps running: gateway {stack.url}, admin token {stack.admin_token}\n"
                f"{stack.runbook_variables()}\nCtrl-C stops it."
            )
        else:
            print("\nstopping (use `make up` to keep the stack running)")
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keep", action="store_true", help="keep the stack running until Ctrl-C")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    args = parser.parse_args()
    # priority classes sized for the CPU worker, unless the environment sets its own
    classes = "RADIXGATE_PRIORITY_CLASSES" in os.environ
    env = {} if classes else {"RADIXGATE_PRIORITY_CLASSES": CPU_PRIORITY_CLASSES}
    stack = LocalStack(RUN, port=args.port, env=env)
    print(f"starting redis-server, one SGLang CPU worker and the gateway on {stack.url}")
    print(f"(logs in {RUN}; the worker needs 20-60 s to load the model)")
    # the gateway finds the engine and the model where `make engine` put them: the home setting
    print(f"(engine and model under {configured_home()}: RADIXGATE_HOME, default ~/.cache/radixgate)")
    if not classes:
        print("classes sized for the CPU worker: TTFT goals 1.5, 4 and 15 s (interactive, standard, batch)")
    t0 = time.monotonic()
    with terminate_as_exit():  # SIGTERM / SIGHUP (a closed terminal) stop the stack like Ctrl-C
        try:
            stack.start()  # stops what it started when the wait ends early
        except StackError as exc:
            sys.exit(str(exc))
        except KeyboardInterrupt:
            sys.exit("interrupted; the stack is stopped")
        serve(stack, args.keep, t0)


if __name__ == "__main__":
    main()
