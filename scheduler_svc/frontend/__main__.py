"""`python -m scheduler_svc.frontend`: one front end, started by the scheduler's cluster
process with a `FrontendLaunch` on stdin (scheduler_svc.frontend.server). Not started by
hand: it needs the addresses its cluster chose for it."""

import asyncio
import logging
import sys

from scheduler_svc.cluster.wire import FrontendLaunch
from scheduler_svc.frontend.server import serve
from services import subprocesses

log = logging.getLogger("scheduler_svc.frontend")


def main() -> int:
    launch = subprocesses.start_child(FrontendLaunch, log)
    return 2 if launch is None else asyncio.run(serve(launch))


if __name__ == "__main__":
    sys.exit(main())
