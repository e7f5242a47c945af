"""`python -m scheduler_svc.frontend`: one front end, started by the scheduler's cluster
process with a `FrontendLaunch` on stdin (scheduler_svc.frontend.server). Not started by
hand: it needs the addresses its cluster chose for it."""

import asyncio
import logging
import signal
import sys

from scheduler_svc.cluster.wire import FrontendLaunch
from scheduler_svc.frontend.server import serve
from services import cluster_token, subprocesses
from services.codec import Codec, DecodeError

log = logging.getLogger("scheduler_svc.frontend")


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the cluster stops its front ends
    if cluster_token.join(log) is None:
        return 2
    try:
        launch = Codec(FrontendLaunch).decode(subprocesses.read_settings())
    except (DecodeError, ValueError) as exc:
        logging.basicConfig()
        log.error("bad FrontendLaunch on stdin: %s", exc)
        return 2
    subprocesses.die_with_parent(launch.parent_pid)
    logging.basicConfig(level=launch.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(launch))


if __name__ == "__main__":
    sys.exit(main())
