"""The KV store's frozen config, and the store that config builds.

The flags are declared with kvcache_svc's others (services.service_flags.add_kvcache_flags);
`kvcache_svc.__main__` reads them back with `store_config`. The store is on by default (host
memory only); `--kv-store-dir` adds a disk tier that survives a restart.
"""

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from kvcache_svc.kv_store.disk_tier import DiskTier
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.kv_store.tier import StoreTier
from services.flags import FlagParser
from services.kv_store_wire import MAX_CHUNK_TOKENS

GIB = 1 << 30


@dataclass(frozen=True)
class KvStoreConfig:
    port: int                   # ZMQ ROUTER of the store; 0 = any free port
    chunk_tokens: int           # tokens per full chunk (a multiple of every pool's block size)
    memory_bytes: int           # host-memory tier budget
    disk_dir: Path | None       # disk tier directory (None: no disk tier)
    disk_bytes: int             # disk tier budget
    # Tests only (SPLITSERVE_TEST_KV_DISK_DELAY_MS): seconds the disk tier sleeps per chunk
    # read or written, a slow disk.
    disk_delay_s: float = 0.0


def store_config(args: argparse.Namespace, parser: FlagParser) -> KvStoreConfig | None:
    """The store's config from parsed flags (None: --no-kv-store); bad values exit through
    `parser.error`."""
    if args.no_kv_store:
        return None
    if not 0 <= args.kv_store_port <= 65535:
        parser.error("--kv-store-port must be in [0, 65535]")
    if not 1 <= args.kv_chunk_tokens <= MAX_CHUNK_TOKENS:
        parser.error(f"--kv-chunk-tokens must be in [1, {MAX_CHUNK_TOKENS}]")
    for name in ("kv_store_memory_gib", "kv_store_disk_gib"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            parser.error(f"--{name.replace('_', '-')} must be a number >= 0")
    delay_ms = parser.env("TEST_KV_DISK_DELAY_MS", float, 0.0)
    if not (math.isfinite(delay_ms) and 0 <= delay_ms <= 60_000):
        parser.error("SPLITSERVE_TEST_KV_DISK_DELAY_MS must be in [0, 60000]")
    return KvStoreConfig(args.kv_store_port, args.kv_chunk_tokens,
                         int(args.kv_store_memory_gib * GIB), args.kv_store_dir,
                         int(args.kv_store_disk_gib * GIB), delay_ms / 1000)


def build_store(config: KvStoreConfig) -> KvStore:
    """Memory tier, then the disk tier when configured. Raises OSError when the directory
    cannot be used (or another process holds it)."""
    tiers: list[StoreTier] = [MemoryTier(config.memory_bytes)]
    if config.disk_dir is not None:
        tiers.append(DiskTier(config.disk_dir, config.disk_bytes, config.disk_delay_s))
    return KvStore(tiers, config.chunk_tokens)
