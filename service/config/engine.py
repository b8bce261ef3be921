"""The engine part of the Settings tree: where radixgate keeps what it builds (``home``, ``RADIXGATE_HOME``)
and how the gateway launches SGLang workers (:class:`EngineSettings`).

Split from :mod:`service.config.settings`, which assembles the tree (and re-exports these names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from policies.classes import PREEMPTION_THRESHOLD
from service.config.checks import CpuCores, field_error
from service.config.policies import FINITE

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
"""The model ``make engine`` converts (``scripts/engine/setup.sh``) and the gateway serves by default."""


def default_home() -> Path:
    """``~/.cache/radixgate``: the ``home`` setting when ``RADIXGATE_HOME`` is not set."""
    return Path.home() / ".cache" / "radixgate"


def home_engine_paths(home: Path) -> dict[str, Path]:
    """What ``make engine`` builds under ``home`` (``scripts/home.sh`` names the same paths for the shell):
    ``python`` (the engine virtualenv's interpreter), ``model_path`` (the converted model's folder) and
    ``peers`` (the bench's peer virtualenvs, ``scripts/peers/setup.sh``)."""
    return {
        "python": home / "engine-venv" / "bin" / "python",
        "model_path": home / "models" / DEFAULT_MODEL,
        "peers": home / "peers",
    }


class HomeSettings(BaseSettings):
    """The ``home`` setting alone (``RADIXGATE_HOME``), the base of :class:`service.config.settings.Settings`.

    Tools that need only the folder (the demo, the bench, the test fixtures) read it with
    :func:`configured_home`, so a bad unrelated setting does not stop them.
    """

    model_config = SettingsConfigDict(env_prefix="RADIXGATE_", extra="ignore", env_file=None)

    home: Path = Field(
        default_factory=default_home,
        description="Folder of what `make engine` builds (engine-venv/, models/) and of the bench's "
        "peers/; engine.python and engine.model_path default to paths under it.",
    )

    @field_validator("home")
    @classmethod
    def _expand_user(cls, value: Path) -> Path:
        return value.expanduser()


def configured_home() -> Path:
    """The ``home`` setting as the gateway reads it: ``RADIXGATE_HOME``, else ``~/.cache/radixgate``."""
    return HomeSettings().home


def default_cpu_shim() -> Path | None:
    """The repository's CPU-only ``sgl_kernel`` stand-in folder, if this is a source checkout."""
    shim = Path(__file__).resolve().parents[2] / "scripts" / "engine" / "shim"
    return shim if shim.is_dir() else None


class EngineSettings(BaseModel):
    """How the gateway launches SGLang workers itself (``launch: true``).

    The command is ``python -m sglang.launch_server`` from ``python`` (the engine's own virtualenv).
    """

    model_config = FINITE

    launch: bool = Field(False, description="Start SGLang workers as child processes at startup.")
    python: Path = Field(
        default_factory=lambda: home_engine_paths(default_home())["python"],
        description="Python of the engine virtualenv (unset: under home, where `make engine` builds it).",
    )
    model_path: Path = Field(
        default_factory=lambda: home_engine_paths(default_home())["model_path"],
        description="Hugging Face model folder (unset: under home, where `make engine` converts it).",
    )
    served_model_name: str = Field(DEFAULT_MODEL, description="Model id served on /v1/models.")
    num_workers: int = Field(1, ge=1, description="How many worker processes to launch.")
    base_port: int = Field(30000, ge=1, le=65535, description="Port of the first launched worker.")
    host: str = Field("127.0.0.1", description="Interface launched workers listen on.")
    tp: int = Field(1, ge=1, description="Tensor-parallel size (--tp) of each worker.")
    dp: int = Field(1, ge=1, description="Data-parallel size (--dp) of each worker.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="--device of each worker.")
    dtype: str = Field("auto", description="--dtype; float32 is used on CPU when 'auto'.")
    schedule_policy: str = Field(
        "fcfs", description="--schedule-policy; SGLang allows only fcfs or lof with priority scheduling."
    )
    mem_fraction_static: float | None = Field(None, gt=0, le=1, description="--mem-fraction-static.")
    max_running_requests: int | None = Field(
        None,
        ge=1,
        description="--max-running-requests; unset: SGLang's own (from the KV pool) on GPUs, "
        "cpu_max_running_requests on CPU.",
    )
    cpu_max_running_requests: int = Field(
        8,
        ge=1,
        description="--max-running-requests of CPU workers when max_running_requests is unset: SGLang "
        "derives 2048 from the KV pool, but a CPU's decode throughput stops growing at a small batch, and a "
        "larger one only lengthens every step (TTFT and ITL): measured on 2 cores, 16-token answers, 3.3 "
        "req/s at 8 running, 3.4 at 16, 3.6 at 32 (2.2 at 4).",
    )
    cpu_affinity: CpuCores = Field(
        None,
        description="CPU core ids a launched CPU worker's processes run on (sched_setaffinity before exec, "
        "OMP_NUM_THREADS to match), e.g. [1] keeps the engine off the gateway's core 0; unset: every core.",
    )
    priority_preemption_threshold: int = Field(
        PREEMPTION_THRESHOLD,
        ge=0,
        description="--priority-scheduling-preemption-threshold: a waiting request preempts running ones "
        "whose SGLang priority is lower by more than this (SGLang's default 10 never lets the default "
        "classes' gaps of 5 and 10 preempt).",
    )
    context_length: int | None = Field(None, ge=1, description="--context-length override.")
    incremental_streaming: bool = Field(
        True,
        description="--incremental-streaming-output: each streamed chunk carries only its new text and "
        "ids (cumulative chunks repeat the answer so far: O(n^2) over a stream, engine and gateway).",
    )
    extra_args: list[str] = Field(default_factory=list, description="Further launch_server arguments.")
    cpu_shim_path: Path | None = Field(
        default_factory=default_cpu_shim,
        description="Folder with the CPU-only sgl_kernel stand-in, put on PYTHONPATH on CPU only.",
    )
    startup_timeout_s: float = Field(300.0, gt=0, description="How long to wait for /health, seconds.")
    log_dir: Path | None = Field(
        None, description="Folder for launched workers' output (worker-<port>.log); None: the gateway's."
    )
    supervise: bool = Field(
        True, description="Restart launched workers whose process group dies or that stay unhealthy."
    )
    supervise_interval_s: float = Field(1.0, gt=0, description="Period of the supervisor's checks, s.")
    unhealthy_restart_s: float = Field(
        60.0, gt=0, description="A live worker whose /health fails this long is restarted, s."
    )
    restart_backoff_base_s: float = Field(
        1.0, gt=0, description="Wait before the first restart in a row, s (doubles, jittered)."
    )
    restart_backoff_max_s: float = Field(60.0, gt=0, description="Longest wait between restarts, s.")
    restart_stable_s: float = Field(
        300.0, gt=0, description="A worker up this long resets the restart backoff, s."
    )

    @model_validator(mode="after")
    def _backoff_order(self) -> EngineSettings:
        if self.restart_backoff_max_s < self.restart_backoff_base_s:
            raise field_error(
                self,
                ("restart_backoff_max_s", "restart_backoff_base_s"),
                f"engine.restart_backoff_max_s ({self.restart_backoff_max_s}) must be at least "
                f"engine.restart_backoff_base_s ({self.restart_backoff_base_s})",
            )
        return self
