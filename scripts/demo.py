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
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(url: str, timeout_s: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with code {proc.returncode}; see the logs in {RUN}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"{what} not ready after {timeout_s:.0f} s; see the logs in {RUN}")


def start_redis(port: int) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed: run `make setup`")
    log = open(RUN / "redis.log", "wb")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(RUN)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def start_gateway(port: int, redis_port: int, admin_token: str, worker_port: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "RADIXGATE_PORT": str(port),
        "RADIXGATE_ADMIN_TOKEN": admin_token,
        "RADIXGATE_KEY_PEPPER": secrets.token_hex(16),
        "RADIXGATE_REDIS__URL": f"redis://127.0.0.1:{redis_port}/0",
        "RADIXGATE_ENGINE__LAUNCH": "true",
        "RADIXGATE_ENGINE__BASE_PORT": str(worker_port),
        "RADIXGATE_ENGINE__CPU_SHIM_PATH": str(ROOT / "scripts" / "engine" / "shim"),
    }
    log = open(RUN / "gateway.log", "wb")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(
        [sys.executable, "-m", "service", "serve"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes], group: bool = False) -> None:
    if proc.poll() is not None:
        return
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()


def create_tenant(admin: httpx.Client, body: dict[str, object]) -> str:
    resp = admin.post("/admin/tenants", json=body)
    resp.raise_for_status()
    key = admin.post(f"/admin/tenants/{body['id']}/keys", json={"name": "demo"})
    key.raise_for_status()
    api_key: str = key.json()["api_key"]
    print(f"  tenant {body['id']!r:8} quotas={body.get('quotas', {})} key={api_key[:16]}… (shown once)")
    return api_key


def run_requests(base: str, admin_token: str) -> None:
    admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {admin_token}"}, timeout=60)
    print("\n== 1. tenants, created through the admin API")
    acme_key = create_tenant(
        admin,
        {
            "id": "acme",
            "name": "Acme Corp",
            "priority_class": "interactive",
            "quotas": {"requests_per_min": 600, "tokens_per_min": 200_000},
        },
    )
    tiny_key = create_tenant(
        admin,
        {"id": "tiny", "name": "Tiny Startup", "quotas": {"requests_per_min": 2, "tokens_per_min": 20_000}},
    )
    model = admin.get("/v1/models", headers={"Authorization": f"Bearer {acme_key}"}).json()["data"][0]["id"]

    acme = openai.OpenAI(base_url=f"{base}/v1", api_key=acme_key, max_retries=0)
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keep", action="store_true", help="keep the stack running until Ctrl-C")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    args = parser.parse_args()
    RUN.mkdir(exist_ok=True)
    redis_port, worker_port = free_port(), free_port()
    admin_token = os.environ.get("RADIXGATE_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    base = f"http://127.0.0.1:{args.port}"
    print(f"starting redis-server :{redis_port}, gateway {base} with one SGLang CPU worker :{worker_port}")
    print(f"(logs in {RUN}; the worker needs 20-60 s to load the model)")
    redis_proc = start_redis(redis_port)
    gateway = start_gateway(args.port, redis_port, admin_token, worker_port)
    try:
        t0 = time.monotonic()
        wait_until(f"{base}/readyz", 600, "gateway", gateway)
        print(f"gateway ready after {time.monotonic() - t0:.0f} s")
        run_requests(base, admin_token)
        if args.keep:
            print(f"\nThe stack keeps running: gateway {base}, admin token {admin_token}\nCtrl-C stops it.")
            try:
                while gateway.poll() is None:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        else:
            print("\nstopping (use `make up` to keep the stack running)")
    finally:
        stop(gateway, group=True)
        stop(redis_proc)


if __name__ == "__main__":
    main()
