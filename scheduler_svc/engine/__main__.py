"""`python -m scheduler_svc.engine`: one replica's engine core, started by the scheduler's
cluster process with an `EngineLaunch` on stdin (scheduler_svc.engine.service). Not started
by hand: it needs the addresses its cluster chose for it."""

import logging
import sys

from scheduler_svc.engine.service import serve
from scheduler_svc.engine.wire import EngineLaunch
from services import subprocesses

log = logging.getLogger("scheduler_svc.engine")


def main() -> int:
    launch = subprocesses.start_child(EngineLaunch, log)
    return 2 if launch is None else serve(launch)


if __name__ == "__main__":
    sys.exit(main())
