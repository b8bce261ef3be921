"""The window's size, ceiling and headroom, kept as derived values, follow its limit through any sequence of
load reports in every mode (they are recomputed when a report changes the limit or the engine's maximum,
not on each read)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.windows import LoadReport, WindowConfig, WorkerWindow


def reference(window: WorkerWindow) -> tuple[int, int, int]:
    """``(ceiling, size, headroom)`` computed from the window's state as the docstrings define them."""
    cfg = window.config
    cap = cfg.maximum
    if cfg.mode == "engine" and window.engine_max is not None:
        cap = min(cap, window.engine_max)
    ceiling = max(cfg.minimum, cap)
    size = cfg.initial if cfg.mode == "fixed" else max(cfg.minimum, min(ceiling, int(window.limit)))
    headroom = max(cfg.top_band_headroom, int(cfg.top_band_headroom_fraction * size))
    return ceiling, size, headroom


reports = st.builds(
    LoadReport,
    running=st.integers(0, 300),
    queued=st.integers(0, 300),
    kv_usage=st.floats(0.0, 1.0),
    max_running=st.none() | st.integers(1, 400),
)


@settings(max_examples=300, deadline=None)
@given(
    mode=st.sampled_from(["engine", "aimd", "fixed"]),
    initial=st.integers(1, 64),
    maximum=st.integers(64, 512),
    fraction=st.sampled_from([0.0, 0.25, 1.0]),
    slow_start=st.booleans(),
    steps=st.lists(
        st.tuples(reports, st.integers(0, 400), st.none() | st.floats(0.0, 2.0)), min_size=1, max_size=25
    ),
)
def test_derived_values_follow_every_report(
    mode: str,
    initial: int,
    maximum: int,
    fraction: float,
    slow_start: bool,
    steps: list[tuple[LoadReport, int, float | None]],
) -> None:
    cfg = WindowConfig(
        mode=mode,  # type: ignore[arg-type]
        initial=initial,
        maximum=maximum,
        top_band_headroom_fraction=fraction,
        slow_start=slow_start,
    )
    window = WorkerWindow(cfg, ttft_target_s=0.5)
    assert (window.ceiling, window.size, window.headroom) == reference(window)
    sizes = {window.size}
    for report, in_flight, engine_ttft_s in steps:
        window.on_report(report, in_flight, engine_ttft_s)
        assert (window.ceiling, window.size, window.headroom) == reference(window)
        sizes.add(window.size)


def test_first_engine_report_starts_the_window_at_the_engines_maximum() -> None:
    """The first report that names ``max_running`` moves a slow-starting window there at once, and a lower
    maximum reported later caps it at once."""
    window = WorkerWindow(WindowConfig(initial=8, maximum=1024), ttft_target_s=0.5)
    assert window.size == 8
    window.on_report(LoadReport(0, 0, 0.0, 48), 0, None)
    assert (window.size, window.ceiling) == (48, 48)
    window.on_report(LoadReport(40, 0, 0.1, 32), 48, 0.1)  # the engine now says 32: capped at once
    assert (window.size, window.ceiling) == (32, 32)
