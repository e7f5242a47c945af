"""`python -m scheduler_svc.engine`: one replica's engine core, started by the scheduler's
cluster process with an `EngineLaunch` on stdin (scheduler_svc.engine.service). Not started
by hand: it needs the addresses its cluster chose for it."""

import logging
import signal
import sys

from scheduler_svc.engine.service import serve
from scheduler_svc.engine.wire import EngineLaunch
from services import cluster_token, subprocesses
from services.codec import Codec, DecodeError

log = logging.getLogger("scheduler_svc.engine")


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the cluster stops its engine cores
    if cluster_token.join(log) is None:
        return 2
    try:
        launch = Codec(EngineLaunch).decode(subprocesses.read_settings())
    except (DecodeError, ValueError) as exc:
        logging.basicConfig()
        log.error("bad EngineLaunch on stdin: %s", exc)
        return 2
    subprocesses.die_with_parent(launch.parent_pid)
    logging.basicConfig(level=launch.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(launch)


if __name__ == "__main__":
    sys.exit(main())
