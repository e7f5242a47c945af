"""Fixtures of the front end's tests: a front end on the default model's tokenizer with fake
engine links and a real router (its kvcache_svc unreachable), closed after each test."""

from collections.abc import Iterator

import pytest
import zmq

from scheduler_svc.frontend.core import Frontend
from scheduler_svc.frontend.router import Router
from scheduler_svc.frontend.validation import Limits
from tests.scheduler_svc.frontend.fakes import FakeEngineLinks, make_frontend, make_router

MAX_MODEL_LEN = 1024


@pytest.fixture
def router(ctx: zmq.Context) -> Iterator[Router]:
    r = make_router(ctx)
    yield r
    r.close()


@pytest.fixture
def links() -> FakeEngineLinks:
    return FakeEngineLinks()


@pytest.fixture
def frontend(tokenizer, router: Router,  # type: ignore[no-untyped-def]
             links: FakeEngineLinks) -> Iterator[Frontend]:
    f = make_frontend(tokenizer, Limits("m", tokenizer.vocab_size, MAX_MODEL_LEN), router,
                      links)
    yield f
    f.close()
