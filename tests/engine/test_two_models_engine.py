"""Issue 27 against the real SGLang CPU worker: SmolLM2 on ``engine_worker`` and a simulated second model
(``loadgen.sim``, stub tokenizer with a Llama-3-like template) behind one gateway. Each model's requests
reach its own worker only, each prompt is counted by the gateway with its model's tokenizer exactly as its
worker counts it, and each context length is what the workers report."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.app import create_app
from service.config.settings import Settings
from service.pipeline.prompting import PromptRenderer
from service.workers.launcher import WorkerProcess
from service.workers.worker_info import WorkerInfo
from tests.conftest import ADMIN_TOKEN
from tests.service.pipeline.test_two_models import LLAMA, MESSAGES, llama_folder
from tests.support.engine import engine_home
from tests.support.servers import ThreadedServer

pytestmark = pytest.mark.engine

SMOL = "SmolLM2-135M-Instruct"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def stack(
    redis_url: str, engine_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, SimServer, Path]]:
    """(gateway URL, the simulated worker, its tokenizer folder)."""
    llama_dir = llama_folder(tmp_path_factory.mktemp("llama"))
    sim = SimServer(get_profile("llama-3.1-8b-h100"), model_name=LLAMA)
    with ThreadedServer(sim.app) as sim_server:
        settings = Settings.model_validate(
            {
                "home": engine_home(),  # SmolLM2's tokenizer: engine.model_path under it
                "admin_token": ADMIN_TOKEN,
                "redis": {"url": redis_url, "key_prefix": "two-engine:"},
                "models": [
                    {
                        "id": SMOL,
                        "workers": [engine_worker.url],
                        "priority_classes": {"standard": {"ttft_goal_ms": 20_000}},
                    },
                    {"id": LLAMA, "workers": [sim_server.url], "tokenizer_path": str(llama_dir)},
                ],
            }
        )
        with ThreadedServer(create_app(settings)) as gw:
            yield gw.url, sim, llama_dir


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}


def test_two_models_with_the_real_worker(
    stack: tuple[str, SimServer, Path], engine_worker: WorkerProcess
) -> None:
    url, sim, llama_dir = stack
    with httpx.Client(base_url=url, timeout=120) as http:
        http.post("/admin/tenants", json={"id": "two", "name": "two"}, headers=ADMIN).raise_for_status()
        issued = http.post("/admin/tenants/two/keys", json={"name": "k"}, headers=ADMIN)
        auth = {"Authorization": f"Bearer {issued.json()['api_key']}"}
        models = {m["id"]: m for m in http.get("/v1/models", headers=auth).json()["data"]}
        # /v1/models shows the enforced limit: what each worker's /server_info says it runs (SGLang keeps
        # a reserve below the model's context), no setting
        smol_info = httpx.get(f"{engine_worker.url}/server_info", timeout=10).json()
        llama_info = TestClient(sim.app).get("/server_info").json()
        for model, body in ((SMOL, smol_info), (LLAMA, llama_info)):
            info = WorkerInfo.parse(body)
            assert info.limits is not None and info.context_length is not None
            assert models[model]["context_length"] == info.limits.max_total_tokens < info.context_length
        before = sim.generate_calls
        smol = http.post("/v1/chat/completions", json=chat(SMOL), headers=auth)
        assert smol.status_code == 200, smol.text
        assert sim.generate_calls == before  # SmolLM2's request went to the CPU worker only
        llama = http.post("/v1/chat/completions", json=chat(LLAMA), headers=auth)
        assert llama.status_code == 200, llama.text
        assert sim.generate_calls == before + 1
        workers = {w["url"]: w["model"] for w in http.get("/admin/workers", headers=ADMIN).json()["data"]}
    smol_dir = Settings.model_validate({"home": engine_home()}).engine.model_path
    for answer, folder in ((smol, smol_dir), (llama, llama_dir)):
        counted = PromptRenderer(folder).render_chat(MESSAGES).num_tokens
        assert answer.json()["usage"]["prompt_tokens"] == counted  # its worker counts what the gateway did
    assert workers[engine_worker.url] == SMOL and set(workers.values()) == {SMOL, LLAMA}
