"""The served models of one replica: per model its tokenizer and chat template, and its own admission core.

A request names a model (an id or an alias, :class:`service.config.models.ModelRegistry`); its lane
(:class:`ModelLane`) renders and counts its prompt with that model's tokenizer and template, and its
:class:`~service.pipeline.scheduler.Scheduler` queues, routes and sheds it among that model's workers only
(:meth:`service.workers.pool.WorkerPool.eligibility`), with that model's class goals, windows, estimates
and routing policy: one model's overload fills its own workers' queues, never another model's. Models
with the same tokenizer folder share one renderer (and its caches).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from policies.admission_types import WorkerSnapshot
from policies.windows import WorkerWindow
from service.config.models import DEFAULT_CONTEXT_LENGTH, ModelRegistry, ServedModel
from service.config.settings import Settings
from service.observability.metrics import GatewayMetrics
from service.pipeline.prompting import PromptRenderer
from service.pipeline.scheduler import EndRequest, Scheduler
from service.workers.client import SGLangClient
from service.workers.pool import WorkerPool
from service.workers.worker_info import TokenLimits


def usable_limits(setting: int | None, reported: TokenLimits | None) -> TokenLimits:
    """The token limits a request to a model is held to: the smaller of its ``context_length`` setting
    (prompt + completion; a prompt one token less) and the limits its workers reported, field by field
    (SGLang keeps a reserve below the model's context: a worker of context 8,192 runs at most 8,190 tokens,
    :meth:`service.workers.worker_info.WorkerInfo.parse`); the workers' alone when nothing is set, and
    :data:`DEFAULT_CONTEXT_LENGTH` only when neither says.

    Args:
        setting: the model's context length setting, tokens (None: unset).
        reported: the tightest limits its workers reported (None: none did).
    """
    if setting is None:
        if reported is not None:
            return reported
        setting = DEFAULT_CONTEXT_LENGTH
    return TokenLimits(setting - 1, setting).tightest(reported)


@dataclass(frozen=True, slots=True)
class ModelLane:
    """One model's part of the replica.

    Attributes:
        model: the model and its resolved settings.
        renderer: its chat template and tokenizer.
        scheduler: its admission core's adapter.
    """

    model: ServedModel
    renderer: PromptRenderer
    scheduler: Scheduler


class ServedModels:
    """Every model's lane, and the workers' view across them.

    Args:
        settings: app settings.
        pool: the workers of every model (each knows its model).
        client: SGLang client (what the workers reported of themselves).
        metrics: the app's metrics.
        end_request: passed to each model's scheduler.
        registry: the models; default: the settings'.
        renderers: renderers already loaded, by tokenizer folder (tests); the others are loaded here.
        window_share: this replica's share of a worker's window, passed to each scheduler.
        on_route: told of each dispatch, passed to each scheduler (router replica sync).

    Raises:
        FileNotFoundError: a model's tokenizer folder has no ``tokenizer.json``.
    """

    def __init__(
        self,
        settings: Settings,
        pool: WorkerPool,
        client: SGLangClient,
        metrics: GatewayMetrics,
        end_request: EndRequest | None = None,
        registry: ModelRegistry | None = None,
        renderers: Mapping[Path, PromptRenderer] | None = None,
        window_share: Callable[[int], int] | None = None,
        on_route: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.registry = registry or settings.model_registry()
        self._pool = pool
        self._client = client
        loaded = dict(renderers or {})
        self._lanes: dict[str, ModelLane] = {}
        for model in self.registry.models:
            path = model.tokenizer_path
            if path not in loaded:
                loaded[path] = PromptRenderer(path, settings.api.prompt_cache_chars)
            scheduler = Scheduler(
                settings,
                pool,
                client,
                metrics,
                end_request=end_request,
                model=model,
                total_depth=self.depth,
                window_share=window_share,
                on_route=on_route,
            )
            self._lanes[model.id] = ModelLane(model, loaded[path], scheduler)
        self._by_name = {name: self._lanes[m.id] for m in self.registry.models for name in m.names}

    @property
    def lanes(self) -> list[ModelLane]:
        """Every model's lane, the default model's first."""
        return list(self._lanes.values())

    @property
    def default(self) -> ModelLane:
        """The first model's lane."""
        return self._lanes[self.registry.default.id]

    def lane(self, name: str) -> ModelLane | None:
        """The lane of a model id or alias; None when the gateway serves no such model."""
        return self._by_name.get(name)

    def observe_peer_route(self, model_id: str, worker: str, prompt: str) -> None:
        """Another replica sent ``prompt`` to ``worker`` for ``model_id``: that model's router learns it
        (a model this replica does not serve is ignored)."""
        lane = self._lanes.get(model_id)
        if lane is not None:
            lane.scheduler.observe_peer_route(worker, prompt)

    def of(self, model_id: str) -> ModelLane:
        """The lane of a canonical model id (a request's ``model_id``). Raises KeyError when unknown."""
        return self._lanes[model_id]

    # -- what the model's workers report --------------------------------------------------------------
    def token_limits(self, model_id: str) -> TokenLimits | None:
        """The tightest token limits ``model_id``'s workers reported; None while none did."""
        return self._client.token_limits(self._pool.workers_of(model_id))

    def limits(self, model_id: str) -> TokenLimits:
        """``model_id``'s prompt and prompt + completion limits, tokens: :func:`usable_limits` of its
        setting and what its workers reported. What a request is checked against."""
        return usable_limits(self._lanes[model_id].model.context_length, self.token_limits(model_id))

    def context_length(self, model_id: str) -> int:
        """``model_id``'s context length as a client can use it, tokens: the most prompt + ``max_tokens``
        a request may ask for (``limits(model_id).max_total_tokens``, the number a
        ``context_length_exceeded`` refusal names), as ``/v1/models`` shows it."""
        return self.limits(model_id).max_total_tokens

    # -- across the models' cores -------------------------------------------------------------------
    def depth(self, band: str) -> int:
        """Requests of ``band`` queued, every model together."""
        return sum(lane.scheduler.depth(band) for lane in self._lanes.values())

    def snapshot(self) -> list[WorkerSnapshot]:
        """Every core's per-worker state."""
        return [snap for lane in self._lanes.values() for snap in lane.scheduler.snapshot()]

    def window(self, worker: str) -> WorkerWindow | None:
        """The window of ``worker`` in the core of its model (None if no core knows it)."""
        for lane in self._lanes.values():
            window = lane.scheduler.window(worker)
            if window is not None:
                return window
        return None

    def remove_worker(self, url: str) -> None:
        """Forget a worker in every core (it left the pool)."""
        for lane in self._lanes.values():
            lane.scheduler.remove_worker(url)

    async def start(self) -> None:
        """Start every model's scheduler."""
        for lane in self._lanes.values():
            await lane.scheduler.start()

    async def stop(self) -> None:
        """Stop every model's scheduler (what is queued fails with 503)."""
        for lane in self._lanes.values():
            await lane.scheduler.stop()


__all__ = ["ModelLane", "ServedModels"]
