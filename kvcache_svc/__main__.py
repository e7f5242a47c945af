"""`python -m kvcache_svc`: parse the config once, serve until SIGTERM/SIGINT.

Three sockets: plan calls (ZMQ ROUTER), the admin API (gRPC) and KV events (ZMQ PUB; port 0
picks a free one, logged as "KV events on tcp://HOST:PORT"); a fourth for the KV store (ZMQ
ROUTER, logged as "KV store on tcp://HOST:PORT"; `--no-kv-store`: none). The flags
(services.service_flags) fall back to SPLITSERVE_KV_* environment variables for containers.

Exit codes: 0 after a signal, 1 when a port cannot be bound or the plan or store loop fails.
"""

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache_svc.kv_store.config import KvStoreConfig, store_config
from kvcache_svc.server import KvCacheServer
from services import cluster_token
from services.flags import FlagParser
from services.service_flags import add_kvcache_flags

log = logging.getLogger("kvcache_svc")


@dataclass(frozen=True)
class KvCacheConfig:
    host: str           # interface both servers bind
    plan_port: int      # ZMQ ROUTER for plan calls from the scheduler
    admin_port: int     # gRPC KvCacheAdmin + health + reflection
    events_port: int    # ZMQ PUB of KvEventBatch; 0 = any free port
    log_level: str
    store: KvStoreConfig | None = None  # the KV store (None: --no-kv-store)


def parse_config(argv: Sequence[str] | None = None) -> KvCacheConfig:
    parser = add_kvcache_flags(FlagParser(prog="python -m kvcache_svc",
                                          description="splitserve KV-block manager"))
    args = parser.parse_args(argv)
    for name in ("plan_port", "admin_port"):
        if not 1 <= getattr(args, name) <= 65535:
            parser.error(f"--{name.replace('_', '-')} must be in [1, 65535]")
    if not 0 <= args.events_port <= 65535:
        parser.error("--events-port must be in [0, 65535]")
    return KvCacheConfig(args.host, args.plan_port, args.admin_port, args.events_port,
                         args.log_level, store_config(args, parser))


async def serve(config: KvCacheConfig, token: str | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    server = KvCacheServer(config.host, config.plan_port, config.admin_port, config.events_port,
                           on_fatal=lambda: loop.call_soon_threadsafe(stop.set),
                           cluster_token=token, store_config=config.store)
    try:
        await server.start()
    except OSError as exc:
        log.error("kvcache_svc cannot start: %s", exc)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("KV events on %s", server.events_address)
    if server.store_address is not None:
        log.info("KV store on %s", server.store_address)
    log.info("kvcache_svc ready: plan=%s admin=%s:%d epoch=%d",
             server.plan_address, config.host, server.admin_port, server.pools.epoch)
    await stop.wait()
    log.info("kvcache_svc stopping")
    await server.stop()
    return 1 if server.failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (token := cluster_token.join(log)) is None:
        return 2
    return asyncio.run(serve(config, token))


if __name__ == "__main__":
    sys.exit(main())
