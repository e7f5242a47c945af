"""The services' flag tables: each flag declared once (the few that several commands declare
are listed here, each for a reason), every SPLITSERVE_* variable compose and the docs use
still read, and the scheduler's defaults the same as its config objects'."""

from collections import defaultdict
from typing import Any

import pytest

from scheduler_svc.config import ServerConfig
from scheduler_svc.engine.config import SchedulerConfig
from services import cli
from services.flags import FlagParser
from services.service_flags import add_kvcache_flags, add_scheduler_flags, add_worker_flags

UP, SCHEDULER, WORKER, KVCACHE = "up", "scheduler_svc", "worker_svc", "kvcache_svc"

# Flags more than one command declares, on purpose. Each service runs alone too, so its own
# listeners, model and log level are its own flags; `up` owns the cluster's shape and the
# ports, deriving each service's flags from them (services.launcher), and never forwards
# these, so no flag reaches a service from two declarations.
SHARED = {
    "--model": {UP, SCHEDULER, WORKER},          # up gives the scheduler and every worker its
    "--log-level": {UP, SCHEDULER, WORKER, KVCACHE},   # one value
    "--host": {UP, SCHEDULER, WORKER, KVCACHE},  # up's is the scheduler's; the rest 127.0.0.1
    "--port": {UP, SCHEDULER, WORKER},           # up's is the scheduler's; workers' any port
    "--advertise-host": {SCHEDULER, WORKER},     # set by the launcher, never by up's caller
    "--control-port": {UP, SCHEDULER},           # up's default follows --port
    "--metrics-port": {UP, SCHEDULER},           # up's default follows --port
    "--tp": {UP, SCHEDULER},                     # up also starts tp x pp x replicas workers
    "--pp": {UP, SCHEDULER},
    "--device": {UP, WORKER},                    # up plans one device per worker
    "--threads": {UP, WORKER},                   # up divides the CPUs among the workers
}


def tables() -> dict[str, FlagParser]:
    return {UP: cli.add_up_flags(FlagParser(environ={})),
            SCHEDULER: add_scheduler_flags(FlagParser(environ={})),
            WORKER: add_worker_flags(FlagParser(environ={})),
            KVCACHE: add_kvcache_flags(FlagParser(environ={}))}


def test_no_flag_is_declared_twice_but_the_listed_ones() -> None:
    declared_by: dict[str, set[str]] = defaultdict(set)
    for command, parser in tables().items():
        for option in parser.flags:
            declared_by[option].add(command)
    assert {option: by for option, by in declared_by.items() if len(by) > 1} == SHARED


def test_up_never_forwards_a_shared_flag() -> None:
    """`up` parses its own; the launcher sets the rest (services.launcher.SET_BY_LAUNCHER)."""
    own = tables()[UP].flags
    for option in SHARED:
        if option not in own:
            with pytest.raises(cli.ForwardError, match="sets it itself"):
                cli.forward_flags([option, "x"], cli.service_parsers())


# Every variable read before the flags had one table, with a value and what it must become.
ENV = {
    SCHEDULER: {
        "MODEL": ("model", "/m.gguf", "/m.gguf"),
        "SERVED_MODEL_NAME": ("served_model_name", "mine", "mine"),
        "HOST": ("host", "0.0.0.0", "0.0.0.0"),
        "PORT": ("port", "6000", 6000),
        "CONTROL_HOST": ("control_host", "0.0.0.0", "0.0.0.0"),
        "CONTROL_PORT": ("control_port", "6001", 6001),
        "ADVERTISE_HOST": ("advertise_host", "scheduler", "scheduler"),
        "KVCACHE": ("kvcache", "tcp://kvcache:1", "tcp://kvcache:1"),
        "DTYPE": ("dtype", "bfloat16", "bfloat16"),
        "TP": ("tp", "2", 2),
        "PP": ("pp", "3", 3),
        "MAX_NUM_SEQS": ("max_num_seqs", "7", 7),
        "MAX_NUM_BATCHED_TOKENS": ("max_num_batched_tokens", "99", 99),
        "BLOCK_SIZE": ("block_size", "32", 32),
        "NUM_KV_BLOCKS": ("num_kv_blocks", "64", 64),
        "MAX_PROMPT_BYTES": ("max_prompt_bytes", "1000", 1000),
        "MAX_CONCURRENT_CALLS": ("max_concurrent_calls", "64", 64),
        "NO_CHUNKED_PREFILL": ("no_chunked_prefill", "1", True),
        "NO_PREFIX_CACHING": ("no_prefix_caching", "1", True),
        "ASYNC_SCHEDULING": ("async_scheduling", "0", False),
        "SCHEDULING_POLICY": ("scheduling_policy", "fcfs", "fcfs"),
        "HEARTBEAT_TIMEOUT": ("heartbeat_timeout", "1.5", 1.5),
        "REPLICA_WAIT_TIMEOUT": ("replica_wait_timeout", "5", 5.0),
        "ROUTE_TOKENS_PER_REQUEST": ("route_tokens_per_request", "8", 8.0),
        "METRICS_PORT": ("metrics_port", "-1", -1),
        "LOG_LEVEL": ("log_level", "debug", "debug"),
    },
    WORKER: {
        "SCHEDULER": ("scheduler", "scheduler:50052", "scheduler:50052"),
        "MODEL": ("model", "/m.gguf", "/m.gguf"),
        "WORKER_HOST": ("host", "0.0.0.0", "0.0.0.0"),
        "WORKER_ADVERTISE_HOST": ("advertise_host", "w1", "w1"),
        "WORKER_PORT": ("port", "50060", 50060),
        "WORKER_ID": ("worker_id", "w1", "w1"),
        "DEVICE": ("device", "cuda", "cuda"),
        "KV_CACHE_MEMORY_GIB": ("kv_cache_memory_gib", "0.25", 0.25),
        "GPU_MEMORY_UTILIZATION": ("gpu_memory_utilization", "0.5", 0.5),
        "ENFORCE_EAGER": ("enforce_eager", "true", True),
        "THREADS": ("threads", "3", 3),
        "NO_QUANT_KERNELS": ("no_quant_kernels", "1", True),
        "NO_INT4_KERNELS": ("no_quant_kernels", "1", True),
        "CPU_LEVEL": ("cpu_level", "avx2", "avx2"),
        "HEALTH_FILE": ("health_file", "/tmp/alive", "/tmp/alive"),
        "NULL_MODEL": ("null_model", "1", True),
        "NULL_STEP_MS": ("null_step_ms", "1.92", 1.92),
        "NULL_EOS_STEP": ("null_eos_step", "4", 4),
        "NULL_EOS_SHARE": ("null_eos_share", "0.25", 0.25),
        "NULL_NO_METADATA": ("null_no_metadata", "yes", True),
        "LOG_LEVEL": ("log_level", "debug", "debug"),
    },
    KVCACHE: {
        "KV_HOST": ("host", "0.0.0.0", "0.0.0.0"),
        "KV_PLAN_PORT": ("plan_port", "6053", 6053),
        "KV_ADMIN_PORT": ("admin_port", "6054", 6054),
        "KV_EVENTS_PORT": ("events_port", "0", 0),
    },
}


@pytest.mark.parametrize("command", [SCHEDULER, WORKER, KVCACHE])
def test_every_variable_still_sets_its_flag(command: str) -> None:
    add = {SCHEDULER: add_scheduler_flags, WORKER: add_worker_flags,
           KVCACHE: add_kvcache_flags}[command]
    for var, (dest, text, value) in ENV[command].items():
        args = add(FlagParser(environ={f"SPLITSERVE_{var}": text})).parse_args([])
        assert getattr(args, dest) == value, var
        assert getattr(add(FlagParser(environ={})).parse_args([]), dest) != value, var


def test_scheduler_defaults_are_its_configs() -> None:
    a = add_scheduler_flags(FlagParser(environ={})).parse_args([])
    sched, server = SchedulerConfig(), ServerConfig(model_path="", model_name="")
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.long_prefill_token_threshold,
            a.block_size, not a.no_chunked_prefill, not a.no_prefix_caching,
            a.scheduling_policy) == (
        sched.max_num_seqs, sched.max_num_batched_tokens, sched.long_prefill_token_threshold,
        sched.block_size, sched.chunked_prefill, sched.prefix_caching, sched.scheduling_policy)
    same: dict[str, Any] = {
        "host": server.host, "port": server.port, "control_host": server.control_host,
        "control_port": server.control_port, "kvcache": server.kvcache_address,
        "dtype": server.dtype, "tp": server.tp_size, "pp": server.pp_size,
        "num_kv_blocks": server.num_kv_blocks, "step_timeout": server.step_timeout_s,
        "heartbeat_timeout": server.heartbeat_timeout_s,
        "replica_wait_timeout": server.replica_wait_s,
        "route_tokens_per_request": server.route_tokens_per_request,
        "metrics_port": server.metrics_port,
        "max_batches_in_flight": server.max_batches_in_flight,
        "max_prompt_bytes": server.max_prompt_bytes,
        "max_concurrent_calls": server.max_concurrent_calls}
    assert {dest: getattr(a, dest) for dest in same} == same
