"""`splitserve`: start a local cluster (`serve`, `up`) or talk to one (`generate`).

    splitserve serve MODEL [-tp 2] [--dtype half] [--config serve.yaml] ...
    splitserve up [--model PATH] [--port 50051] [--http-port 8000] [--dtype auto|...] ...
    splitserve up --device cuda [--gpu-memory-utilization 0.9] [--enforce-eager] ...
    splitserve generate "Tell me a story" [--max-tokens 64] [--json] [--ssl-ca FILE]

`serve MODEL` is `up --model MODEL`, as vLLM's `vllm serve` is spelled: both take vLLM's
names too (`--tensor-parallel-size`/`-tp`, `--pipeline-parallel-size`/`-pp`,
`--[no-]enable-prefix-caching`, `--seed`, `--dtype half|float`) and `--config FILE`, a YAML
mapping of flag names to values under the command line (services.config_file).

`up` owns the cluster's shape (model, ports, tp/pp/replicas, device, threads, logs) and passes
every other flag, as given, to the service that defines it (scheduler_svc, worker_svc,
kvcache_svc, http_svc; their flags are declared once, in services.service_flags). Beside the
gRPC API it starts the OpenAI-compatible HTTP API (http_svc) on --http-port.

`up` gives every service the same cluster token (SPLITSERVE_CLUSTER_TOKEN): the one in the
environment if set, else a fresh one for this cluster that is never shown (set your own to
add workers by hand).
"""

import argparse
import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from services import api_keys, cluster_token, tls
from services.config_file import ConfigFileError
from services.flags import FlagParser
from services.launcher import (
    SET_BY_LAUNCHER,
    ClusterSpec,
    DevicePlanError,
    ServiceProcesses,
    plan_devices,
)
from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc
from services.serve_args import expand_command, prefix_caching
from services.service_flags import (
    HTTP_PORT,
    add_http_flags,
    add_kvcache_flags,
    add_scheduler_flags,
    add_worker_flags,
)


def visible_gpus() -> int:
    """CUDA GPUs torch sees here. torch is imported only when a GPU may be wanted: it takes
    seconds, and `generate` (or `up --device cpu`) never needs it."""
    import torch

    return torch.cuda.device_count()


def cluster_spec(a: argparse.Namespace, num_gpus: int) -> ClusterSpec:
    """`up`'s flags as what to start; raises DevicePlanError when the workers cannot each get
    a GPU of their own among the `num_gpus` this machine has."""
    devices = plan_devices(a.device, a.tp, a.pp, a.replicas, num_gpus)
    metrics_port = a.port + 5 if a.metrics_port is None else a.metrics_port
    control_port = a.port + 1 if a.control_port is None else a.control_port
    return ClusterSpec(model=a.model, host=a.host, port=a.port, control_port=control_port,
                       kv_plan_port=a.port + 2, kv_admin_port=a.port + 3,
                       kv_events_port=a.port + 4, kv_store_port=a.port + 6,
                       metrics_port=metrics_port, tp=a.tp, pp=a.pp,
                       num_replicas=a.replicas, scheduler_args=tuple(a.scheduler_args),
                       worker_args=tuple(a.worker_args), kvcache_args=tuple(a.kvcache_args),
                       http_port=None if a.http_port < 0 else a.http_port,
                       http_args=tuple(a.http_args), threads_per_worker=a.threads,
                       worker_devices=devices, log_level=a.log_level)


def port_clash(spec: ClusterSpec) -> str | None:
    """Which of the cluster's fixed ports the HTTP API's would take, if any."""
    taken = {"--port": spec.port, "--control-port": spec.control_port,
             "--port + 2 (kvcache plan)": spec.kv_plan_port,
             "--port + 3 (kvcache admin)": spec.kv_admin_port,
             "--port + 4 (KV events)": spec.kv_events_port, "--metrics-port": spec.metrics_port,
             "--port + 6 (KV store)": spec.kv_store_port}
    return next((f"--http-port {spec.http_port} is also {name}" for name, port in taken.items()
                 if port == spec.http_port), None)


def _up(a: argparse.Namespace) -> int:
    try:
        spec = cluster_spec(a, 0 if a.device == "cpu" else visible_gpus())
    except DevicePlanError as exc:
        print(f"splitserve: {exc}", file=sys.stderr)
        return 2
    if (clash := port_clash(spec)) is not None:
        print(f"splitserve: {clash}", file=sys.stderr)
        return 2
    procs = ServiceProcesses(spec, Path(a.log_dir) if a.log_dir else None)
    if procs.token_chosen:
        # Refused here rather than by every service at once; a generated one always fits.
        try:
            cluster_token.load({cluster_token.ENV: procs.cluster_token})
        except cluster_token.TokenError as exc:
            print(f"splitserve: {exc}", file=sys.stderr)
            return 2
        print(f"splitserve: every service gets the cluster token from {cluster_token.ENV}",
              file=sys.stderr)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    procs.start()
    http = "" if procs.http_address is None else f", the HTTP API on {procs.http_address}"
    print(f"splitserve: starting kvcache_svc, scheduler_svc and {a.tp * a.pp * a.replicas} "
          f"worker(s) on {', '.join(dict.fromkeys(spec.worker_devices))}, serving on "
          f"{procs.address} (workers' control on {procs.control_address}){http} ...",
          file=sys.stderr)
    try:
        deadline = time.monotonic() + a.startup_timeout
        ready = False
        while not stopping:
            if dead := procs.dead():
                print(f"splitserve: a service exited: {dead}; stopping", file=sys.stderr)
                procs.stop()
                return 1
            if not ready:
                try:
                    procs.wait_ready(timeout_s=0.5)
                    ready = True
                    print(f"splitserve: ready on {procs.address} (Ctrl-C stops everything)",
                          file=sys.stderr)
                    if procs.http_address is not None:
                        print(f"splitserve: OpenAI-compatible HTTP API on "
                              f"http://{procs.http_address}/v1", file=sys.stderr)
                    if spec.metrics_port > 0:
                        print(f"splitserve: metrics on http://{a.host}:{spec.metrics_port}"
                              "/metrics", file=sys.stderr)
                except TimeoutError:
                    if time.monotonic() > deadline:
                        print("splitserve: not ready in time; stopping", file=sys.stderr)
                        procs.stop()
                        return 1
            time.sleep(0.5)
    except RuntimeError as exc:
        print(f"splitserve: {exc}; stopping", file=sys.stderr)
        procs.stop()
        return 1
    codes = procs.stop()
    print(f"splitserve: stopped ({', '.join(f'{n}={c}' for n, c in codes.items())})",
          file=sys.stderr)
    return 0


def _generate(a: argparse.Namespace) -> int:
    sampling = generation_pb2.SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature)
    if a.seed is not None:
        sampling.seed = a.seed
    request = generation_pb2.GenerateRequest(sampling=sampling)
    if a.raw:
        request.text = a.prompt
    else:
        request.chat.messages.add(role="user", content=a.prompt)
    if (error := tls.ca_error("--ssl-ca", a.ssl_ca)) is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    channel = (grpc.insecure_channel(a.address) if a.ssl_ca is None else
               grpc.secure_channel(a.address, tls.channel_credentials(a.ssl_ca)))
    with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        token_ids: list[int] = []
        finish = ""
        try:
            # A cluster with API keys: the first of SPLITSERVE_API_KEY's (services.api_keys).
            key = os.environ.get(api_keys.ENV, "").split(",")[0].strip() or None
            metadata = api_keys.call_metadata(key)
            for chunk in stub.Generate(request, timeout=a.timeout, metadata=metadata):
                token_ids.extend(chunk.token_ids)
                if not a.json:
                    print(chunk.text, end="", flush=True)
                if chunk.finish_reason:
                    finish = chunk.finish_reason
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if a.json:
        print(json.dumps({"token_ids": token_ids, "finish_reason": finish}))
    else:
        print()
    return 0


class ForwardError(ValueError):
    """An argument of `up` that neither `up` nor a service it starts takes."""


def service_parsers() -> dict[str, FlagParser]:
    """The flag tables of the services `up` forwards flags to, by service. They read no
    environment: `up` only checks what it forwards; each service reads its own at start."""
    return {name: add(FlagParser(prog="splitserve up", usage=argparse.SUPPRESS, add_help=False,
                                 environ={}))
            for name, add in (("scheduler_svc", add_scheduler_flags),
                              ("worker_svc", add_worker_flags),
                              ("kvcache_svc", add_kvcache_flags),
                              ("http_svc", add_http_flags))}


def forward_flags(extra: Sequence[str],
                  parsers: Mapping[str, FlagParser]) -> dict[str, list[str]]:
    """`up`'s arguments that are not its own, split by the service that defines each flag (a
    flag several define goes to each), values as given. Each service's parser checks its
    share (exiting on a bad value, as the service would); ForwardError for an argument no
    service takes or one the launcher sets itself."""
    forwarded: dict[str, list[str]] = {name: [] for name in parsers}
    i = 0
    while i < len(extra):
        option, equals, _ = extra[i].partition("=")
        if option in SET_BY_LAUNCHER:
            raise ForwardError(f"{option}: splitserve up sets it itself (the internal "
                               f"sockets on 127.0.0.1, one id per worker)")
        owners = [name for name, p in parsers.items() if option in p.flags]
        if not option.startswith("--") or not owners:
            names = [*parsers]
            raise ForwardError(f"{extra[i]!r} is no flag of splitserve up, "
                               f"{', '.join(names[:-1])} or {names[-1]} (see splitserve up "
                               f"--help)")
        takes_value = parsers[owners[0]].flags[option].nargs != 0
        count = 2 if takes_value and not equals else 1
        for name in owners:
            forwarded[name] += extra[i:i + count]
        i += count
    for name, args in forwarded.items():
        parsers[name].parse_args(args)
    return forwarded


def forwarded_help(own: Mapping[str, object], parsers: Mapping[str, FlagParser]) -> str:
    """`up --help`'s part on the flags it passes on: each with its help, under every service
    that defines it (one that several define goes to each, in each one's sense)."""
    intro = textwrap.fill(
        "Any other flag goes as given to the service that defines it (to each, if several "
        "do). Each also reads its SPLITSERVE_* variable when the flag is not given.", 78,
        break_on_hyphens=False)
    sections = [intro]
    not_forwarded = {*own, *SET_BY_LAUNCHER}
    for name, p in parsers.items():
        actions = [a for a in dict.fromkeys(p.flags.values())
                   if not not_forwarded & set(a.option_strings)]
        formatter = argparse.HelpFormatter("splitserve up", max_help_position=32, width=100)
        formatter.start_section(f"forwarded to {name}")
        formatter.add_arguments(actions)
        formatter.end_section()
        sections.append(formatter.format_help().strip("\n"))
    return "\n\n".join(sections)


def add_up_flags(up: FlagParser) -> FlagParser:
    """`up`'s own flags: what shapes the cluster and applies to every service. The services'
    flags are not repeated here (`forward_flags`)."""
    up.add_flag("--model", help="GGUF file or HF directory, for the scheduler and every worker "
                "(default: SmolLM2-135M)")
    up.add_flag("--host", default="127.0.0.1",
                help="interface of the client and metrics ports (the services' internal "
                     "sockets stay on 127.0.0.1)")
    up.add_flag("--port", type=int, default=50051, help="client gRPC port; kvcache_svc takes "
                "PORT+2 (plan), +3 (admin gRPC), +4 (KV events), +6 (KV store)")
    up.add_flag("--control-port", type=int, default=None,
                help="scheduler's control listener on 127.0.0.1, where workers register "
                     "(default PORT+1: 50052)")
    up.add_flag("--metrics-port", type=int, default=None,
                help="scheduler Prometheus /metrics HTTP port (default PORT+5; -1: off)")
    up.add_flag("--http-port", type=int, default=HTTP_PORT,
                help="the OpenAI-compatible HTTP API (http_svc), on --host (-1: not started)")
    up.add_flag("--device", default="auto",
                help="workers' device: auto (cuda when torch sees a GPU, else cpu), cpu, "
                     "cuda (worker i on cuda:i; one GPU per worker, so tp x pp x replicas "
                     "must not exceed the GPUs) or cuda:N (one worker, on GPU N)")
    up.add_flag("--tp", "--tensor-parallel-size", "-tp", type=int, default=1,
                help="tensor-parallel ranks per replica")
    up.add_flag("--pp", "--pipeline-parallel-size", "-pp", type=int, default=1,
                help="pipeline stages per replica")
    up.add_flag("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                help="vLLM's name: --no-enable-prefix-caching is the scheduler's "
                     "--no-prefix-caching (default: on)")
    up.add_flag("--config", metavar="FILE",
                help="YAML mapping of flag names (with or without dashes; _ or -) to values; "
                     "the command line wins")
    up.add_flag("--replicas", type=int, default=1)
    up.add_flag("--threads", type=int, default=0,
                help="threads per worker (0: this machine's CPUs divided among the workers)")
    up.add_flag("--startup-timeout", type=float, default=300.0)
    up.add_flag("--log-dir", default=None, help="write each service's log here")
    up.add_flag("--log-level", default="info", help="every service's")
    up.epilog = forwarded_help(up.flags, service_parsers())
    return up


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=FlagParser)

    up = add_up_flags(sub.add_parser(
        "up", help="start kvcache_svc, scheduler_svc, the workers and the HTTP API",
        formatter_class=argparse.RawDescriptionHelpFormatter))   # the epilog's own lines
    up.set_defaults(func=_up)
    serve = add_up_flags(sub.add_parser(
        "serve", help="vLLM's spelling of up: `serve MODEL` is `up --model MODEL`",
        usage="splitserve serve [MODEL] [flags]",
        description="MODEL: a GGUF file or HF directory (as up's --model).",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    serve.set_defaults(func=_up)

    gen = sub.add_parser("generate", help="stream a completion from a running cluster")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as raw text (default: one chat user message)")
    gen.add_argument("--json", action="store_true", help="print token ids and finish reason")
    gen.add_argument("--timeout", type=float, default=600.0)
    gen.add_argument("--ssl-ca", metavar="FILE",
                     help="TLS to --address, trusting this PEM CA (the scheduler's "
                          "--ssl-certfile when self-signed); default: plaintext")
    gen.set_defaults(func=_generate)
    return p


def command_flags() -> dict[str, argparse.Action]:
    """Every option string `up` and `serve` take, their own or forwarded, to its action
    (`up`'s own first: those it does not forward)."""
    flags: dict[str, argparse.Action] = {}
    for p in service_parsers().values():
        for option, action in p.flags.items():
            flags.setdefault(option, action)
    return {**flags, **add_up_flags(FlagParser(add_help=False)).flags}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command's arguments; for `up` and `serve`, also the flags they forward
    (`scheduler_args`, `worker_args`, `kvcache_args`, `http_args`)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("up", "serve"):
        try:
            argv = expand_command(argv, command_flags())
        except ConfigFileError as exc:
            parser.exit(2, f"splitserve {argv[0]}: error: {exc}\n")
    args, extra = parser.parse_known_args(argv)
    if args.command not in ("up", "serve"):
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args
    try:
        forwarded = forward_flags(extra, service_parsers())
    except ForwardError as exc:
        parser.exit(2, f"splitserve {args.command}: error: {exc}\n")
    try:
        args.scheduler_args = prefix_caching(args.enable_prefix_caching,
                                             forwarded["scheduler_svc"])
    except ValueError as exc:
        parser.exit(2, f"splitserve {args.command}: error: {exc}\n")
    args.worker_args = forwarded["worker_svc"]
    args.kvcache_args = forwarded["kvcache_svc"]
    args.http_args = forwarded["http_svc"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
