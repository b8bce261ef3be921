"""Command line of the simulated SGLang worker (a simulator, not a model).

``python -m loadgen.sim --profile llama-3.1-8b-h100 --port 30000 [--speed 1.0] [--seed 0]
[--model-name NAME] [--eos-per-token 0.0] [--fault none|crash_mid_stream|slow|http_500]
[--fault-after-tokens N] [--fault-factor X] [--fault-exit] [--dcgm] [--list-profiles]``
and the performance knobs of :mod:`loadgen.sim.knobs` (``--network-delay-s S``, ``--prefill-factor X`` ...).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import uvicorn

from loadgen.sim import knobs
from loadgen.sim.profiles import PROFILES, get_profile
from loadgen.sim.server import FaultSpec, SimServer


def _number(
    kind: type[float] | type[int], low: float, high: float | None, what: str, low_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: a ``kind`` number in [low, high] ((low, high] with ``low_open``; no upper bound
    when ``high`` is None); anything else exits 2 with ``what`` (argparse's message)."""

    def parse(text: str) -> float:
        value = kind(text)
        if value < low or (low_open and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{what} (got {text})")
        return value

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(prog="python -m loadgen.sim", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="smollm2-135m-cpu2", help="step-time profile (--list-profiles)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_number(int, 0, 65535, "from 0 to 65535"), default=30000)
    speed = _number(float, 0, None, "above 0", low_open=True)
    parser.add_argument("--speed", type=speed, default=1.0, help="simulated seconds per wall second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-name", default=None, help="id on /v1/models (default: the profile's)")
    chance = _number(float, 0, 1, "from 0 to 1")
    parser.add_argument("--eos-per-token", type=chance, default=0.0, help="chance per token of a 'stop'")
    parser.add_argument("--fault", default="none", choices=["none", "crash_mid_stream", "slow", "http_500"])
    parser.add_argument("--fault-after-tokens", type=_number(int, 0, None, "at least 0"), default=2)
    parser.add_argument("--fault-factor", type=_number(float, 1, None, "at least 1"), default=5.0)
    parser.add_argument("--fault-exit", action="store_true", help="crash_mid_stream exits the process")
    parser.add_argument("--dcgm", action="store_true", help="export simulated DCGM GPU gauges (GPU profiles)")
    parser.add_argument("--dcgm-hostname", default="sim", help="their Hostname label")
    parser.add_argument("--list-profiles", action="store_true")
    knobs.add_arguments(parser)
    args = parser.parse_args(argv)
    args.knobs = knobs.from_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the server until interrupted."""
    args = parse_args(argv)
    if args.list_profiles:
        for p in PROFILES.values():
            print(f"{p.name:<24} {p.model} on {p.hardware}")
        return 0
    try:
        profile = get_profile(args.profile)
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 2
    fault = FaultSpec(
        mode=args.fault,
        after_tokens=args.fault_after_tokens,
        factor=args.fault_factor,
        exit_process=args.fault_exit,
    )
    try:
        server = SimServer(
            profile,
            args.seed,
            args.speed,
            args.model_name,
            args.eos_per_token,
            fault,
            knobs=args.knobs,
            dcgm=args.dcgm,
            hostname=args.dcgm_hostname,
        )
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    uvicorn.run(server.app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
