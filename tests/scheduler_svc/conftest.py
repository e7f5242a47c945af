"""Fixtures shared by the scheduler's tests."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from scheduler_svc.config import SchedulerConfig, ServerConfig
from scheduler_svc.live_requests import LiveRequests
from scheduler_svc.membership import Membership
from scheduler_svc.router import Router
from services.model_config import load_model_config


@pytest.fixture
def router(model_path: Path) -> Iterator[Router]:
    ctx = zmq.Context()
    config = ServerConfig(model_path=str(model_path), model_name="",
                          kvcache_address="tcp://127.0.0.1:9")
    live = LiveRequests()
    membership = Membership(config, SchedulerConfig(block_size=16),
                            load_model_config(model_path), ctx, live.deliver)
    membership.kv_reachable = True
    r = Router(membership, live, ctx)
    membership.listen(r)
    yield r
    r.shutdown()
    membership.shutdown()
    ctx.destroy(linger=0)
