"""Long-lived objects of one gateway replica, built in the app's lifespan and reached through deps."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from service.config.settings import Settings
from service.observability.metrics import GatewayMetrics
from service.pipeline.billing import Billing
from service.pipeline.dispatch import Dispatcher
from service.pipeline.planner_task import PlannerTask
from service.pipeline.scheduler import Scheduler
from service.pipeline.served_models import ServedModels
from service.runtime.drain import Drain
from service.workers.pool import WorkerPool
from service.workers.registry import WorkerRegistry
from tenancy.quota import QuotaLimiter
from tenancy.store import TenantStore
from tenancy.usage import UsageRecorder


@dataclass(frozen=True, slots=True)
class GatewayState:
    """Everything a request handler may need."""

    settings: Settings
    redis: Redis
    tenants: TenantStore
    quota: QuotaLimiter
    usage: UsageRecorder
    pool: WorkerPool
    dispatcher: Dispatcher
    metrics: GatewayMetrics
    scheduler: Scheduler  # the default (first) model's; ``models`` has every model's
    registry: WorkerRegistry
    drain: Drain  # the process's stopping state: readiness and admission read ``drain.draining``
    models: ServedModels  # every served model: its tokenizer, scheduler, workers' reports
    billing: Billing  # prices and budgets (service/pipeline/billing.py)
    planner: PlannerTask | None = None  # radixgate_desired_workers' decisions (None: planner.enabled off)
