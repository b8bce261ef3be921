"""The gateway tunes Python's cyclic garbage collector from its settings when it starts."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pydantic
import pytest

from service.app import create_app
from service.config.settings import Settings
from tests.conftest import gateway_settings
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer


def test_the_gateway_sets_the_young_generation_threshold(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    before = gc.get_threshold()
    settings = gateway_settings(redis_url, stub_model_dir, [fake[1]]).model_copy(
        update={"gc_young_threshold": 1234}
    )
    try:
        with ThreadedServer(create_app(settings)):
            assert gc.get_threshold() == (1234, before[1], before[2])  # the older generations keep theirs
    finally:
        gc.set_threshold(*before)


def test_a_threshold_that_would_make_the_collector_run_all_the_time_is_refused() -> None:
    assert Settings().gc_young_threshold == 5000
    with pytest.raises(pydantic.ValidationError):
        Settings(gc_young_threshold=10)


def test_a_stopped_gateway_unfreezes_what_it_froze(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    # nu21: the lifespan froze every object alive at startup (gc.freeze) and never unfroze them, so a
    # process that runs the gateway more than once (the test suite, an embedding) kept each stopped
    # gateway (its app, routes, tokenizer, caches: cycles the collector no longer scanned) for good
    before = gc.get_threshold()
    app = create_app(gateway_settings(redis_url, stub_model_dir, [fake[1]]))
    try:
        with ThreadedServer(app):
            assert gc.get_freeze_count() > 0
        gone = weakref.ref(app)
        del app
        gc.collect()
        assert gone() is None
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == before  # the process's own threshold is back
    finally:
        gc.set_threshold(*before)
