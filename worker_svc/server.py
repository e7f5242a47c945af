"""The worker process around a `ModelRunner`: registration, heartbeats and the step loop.

Only the last pipeline stage's tp_rank 0 answers steps; every rank answers InitCache so the
scheduler knows the whole replica allocated its KV tensors. A step that raises on a one-rank
replica is answered with a StepOutput carrying the error: the runner dropped the step's
requests and nothing else changed, so the scheduler fails just those. On a replica of more
ranks the peers may be stuck in a collective (or hold state this rank no longer has), so the
answer is `WorkerFailure` and the scheduler takes the replica down. Either way the worker
keeps serving.

`WorkerConfig.fail_request_prefix` (`SPLITSERVE_TEST_FAIL_REQUEST_PREFIX`, for end-to-end tests
only): every step holding a request whose id starts with it raises before its forward.

Heartbeats start right after registration (a load can take a while) and run on their own
thread. While the scheduler is unreachable the worker keeps running and keeps trying. When a
heartbeat is answered "unknown" (the scheduler restarted, or took this worker's replica down
because a peer was lost) the step loop ends and the worker registers again with a new epoch:
a new member, placed afresh; its loaded shard is kept when the placement is the same.
"""

import gc
import logging
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
import zmq

from services.channels import Receiver, Sender
from services.cluster_token import call_metadata
from services.codec import Codec
from services.cpus import available_cpus
from services.grpc_server import CHANNEL_OPTIONS
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import control_pb2, control_pb2_grpc
from services.wire import CacheReady, FromWorker, InitCache, StepInput, ToWorker, WorkerFailure
from worker_svc.device import DeviceError, device_label, device_uuid, dtype_for
from worker_svc.device import describe as describe_device
from worker_svc.kernels import CpuLevel
from worker_svc.kv_loader import LoadTicket
from worker_svc.kv_saver import KvSaver
from worker_svc.launched_step import LaunchedStep
from worker_svc.runner import ModelRunner
from worker_svc.stage_step import launch_stage

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_RPC_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    scheduler_address: str          # scheduler gRPC HOST:PORT
    model_path: str
    host: str                       # interface for the step socket
    advertise_host: str             # how the scheduler reaches it
    port: int                       # 0 = any free port
    worker_id: str
    epoch: int                      # incarnation, ns since the Unix epoch at start
    device: torch.device            # resolved from --device (worker_svc.device)
    kv_cache_bytes: int             # CPU: the cap on the KV budget
    gpu_memory_utilization: float   # GPU: share of its memory the worker may use
    num_threads: int                # 0 = the CPUs this process may use (services.cpus)
    quant_kernels: bool             # small steps on the GGUF's quantized blocks
    cpu_level: CpuLevel             # the C kernels' instruction set (kernels/cpu.py)
    register_timeout_s: float
    health_file: str | None = None  # touched on every acknowledged heartbeat
    enforce_eager: bool = False     # no CUDA graphs
    cluster_token: str = ""         # presented on every control call (services.cluster_token)
    # Launch the next step before reading the last one's tokens (None: on CUDA only).
    overlap_steps: bool | None = None
    fail_request_prefix: str | None = None  # tests only: steps with such a request raise
    kv_store: str = ""              # kvcache_svc's KV store, tcp://HOST:PORT ("": no saving)


class WorkerServer:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.epoch = config.epoch        # this incarnation's; a re-registration takes a new one
        self._stop = threading.Event()
        self._lost = threading.Event()   # the scheduler no longer knows this incarnation
        self._registered = False         # heartbeats are sent only while registered
        self._metadata = call_metadata(config.cluster_token)
        self._saver: KvSaver | None = None   # its counters ride on heartbeats
        # The loaded shard, kept across registrations while the placement's key is the same.
        self._runner: ModelRunner | None = None
        self._runner_key: tuple[object, ...] | None = None

    @property
    def preferred_dtype(self) -> str:
        """What this worker computes best in (RegisterRequest.preferred_dtype): bfloat16 on
        a GPU or a CPU with a native bfloat16 dot product; elsewhere bfloat16 would compute
        in float32 anyway, and float32 keeps full precision."""
        if self.config.device.type == "cuda" or self.config.cpu_level.native_bf16:
            return "bfloat16"
        return "float32"

    def run(self) -> int:
        cfg = self.config
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        torch.set_num_threads(cfg.num_threads or available_cpus())
        log.info("%d threads; %s", torch.get_num_threads(), describe_device(cfg.device))
        if cfg.device.type == "cuda":
            torch.cuda.set_device(cfg.device)
        ctx = zmq.Context()
        steps: Receiver[ToWorker] = Receiver(ctx, Codec(ToWorker), f"tcp://{cfg.host}:{cfg.port}")
        step_address = f"tcp://{cfg.advertise_host}:{steps.address.rsplit(':', 1)[1]}"
        channel = grpc.insecure_channel(cfg.scheduler_address, options=CHANNEL_OPTIONS)
        control = control_pb2_grpc.WorkerControlStub(channel)
        heartbeat = threading.Thread(target=self._heartbeat, args=(control,), daemon=True,
                                     name="heartbeat")
        heartbeat.start()
        first = True
        try:
            while not self._stop.is_set():
                placement = self._register(control, step_address, first)
                if placement is None:
                    return 0 if self._stop.is_set() else 1
                code = self._incarnation(ctx, control, steps, placement)
                if code is not None:
                    return code
                first = False
                if not self._stop.is_set():
                    self.epoch = time.time_ns()
                    log.warning("the scheduler no longer knows this worker; registering "
                                "again as epoch %d", self.epoch)
            return 0
        finally:
            # End the heartbeat thread before its channel closes: a call on a closed channel
            # raises ValueError in that thread (seen once in CI as a stray traceback on exit).
            self._stop.set()
            heartbeat.join(timeout=HEARTBEAT_RPC_TIMEOUT_S + 1)
            self._drop_runner()
            steps.close()
            channel.close()
            ctx.destroy(linger=0)

    def _incarnation(self, ctx: zmq.Context, control: control_pb2_grpc.WorkerControlStub,
                     steps: Receiver[ToWorker], placement: control_pb2.RegisterResponse,
                     ) -> int | None:
        """One registration's life: join the replica's groups, load (or keep) the shard,
        report capacity, serve until stopped or forgotten. Returns an exit code when the
        process must end, else None (register again; the runner is kept for that)."""
        cfg = self.config
        link = None
        if placement.pp_size * placement.tp_size > 1:
            from worker_svc.parallel import ParallelGroups, RendezvousError

            try:
                link = ParallelGroups(placement.dist_init_method, placement.pp_rank,
                                      placement.pp_size, placement.tp_rank,
                                      placement.tp_size, timeout_s=cfg.register_timeout_s,
                                      device=cfg.device)
            except RendezvousError as exc:
                log.error("%s", exc)
                return 1
        try:
            placed = self._place(placement, link)
            if placed is None:
                return 1
            runner, num_blocks = placed
            try:
                report = control_pb2.CapacityReport(
                    worker_id=cfg.worker_id, epoch=self.epoch, num_kv_blocks=num_blocks,
                    kv_bytes_per_block=runner.kv_bytes_per_block(placement.block_size),
                    kv_store_slice=kv_slice_to_pb(runner))
                control.ReportCapacity(report, timeout=10.0, metadata=self._metadata)
            except grpc.RpcError as exc:
                log.warning("capacity report failed (%s); registering again", exc.code().name)
                self._lost.set()
                return None
            outputs = Sender(ctx, Codec(FromWorker), placement.output_address)
            try:
                self._serve(runner, num_blocks, steps, outputs, placement, link)
            finally:
                outputs.close()
            return None
        finally:
            self._registered = False
            if link is not None:
                link.close()

    def _place(self, placement: control_pb2.RegisterResponse,
               link: "ParallelGroups | None",  # noqa: F821
               ) -> "tuple[ModelRunner, int] | None":  # noqa: F821
        """The runner for `placement` and the KV blocks it can hold, measured afresh. A
        runner kept from the last placement (the same shard) first frees its KV cache,
        graphs and staging buffers, or the measurement would count them as taken; one of
        another shard is closed (its threads too) before the new shard loads. None: the
        shard cannot be served here."""
        key = (placement.first_layer, placement.end_layer, placement.pp_size,
               placement.tp_rank, placement.tp_size, placement.dtype)
        runner = self._runner
        if runner is not None and key != self._runner_key:
            self._drop_runner()
            runner = None
        if runner is None:
            runner = self._load(placement, link)
            if runner is None:
                return None
            self._runner, self._runner_key = runner, key
        else:
            runner.release_cache()
            if link is not None:
                runner.rejoin(link.tp_group)     # same slice, new process group
        return runner, self._capacity(runner, placement)

    def _drop_runner(self) -> None:
        """Closes the kept runner (its KV cache, its saver's and loader's threads)."""
        if self._runner is not None:
            self._runner.close()
        self._runner, self._runner_key, self._saver = None, None, None
        gc.collect()           # the weights go before another shard loads

    def _register(self, control: control_pb2_grpc.WorkerControlStub,
                  step_address: str, first: bool) -> control_pb2.RegisterResponse | None:
        """Registers this incarnation. At start, gives up after --register-timeout; later
        (the scheduler restarted) keeps trying until stopped."""
        cfg = self.config
        model = load_model_config(cfg.model_path)
        request = control_pb2.RegisterRequest(
            worker_id=cfg.worker_id, epoch=self.epoch, device=device_label(cfg.device),
            memory_bytes=cfg.kv_cache_bytes, step_address=step_address, model=model.name,
            preferred_dtype=self.preferred_dtype, cpu_level=cfg.cpu_level.label,
            device_uuid=device_uuid(cfg.device))
        deadline = time.monotonic() + cfg.register_timeout_s
        while not self._stop.is_set():
            try:
                placement = control.Register(request, timeout=5.0, metadata=self._metadata)
                log.info("registered %s as replica %d pp_rank %d/%d tp_rank %d/%d layers "
                         "[%d, %d) dtype %s (this worker prefers %s)", cfg.worker_id,
                         placement.replica_id, placement.pp_rank, placement.pp_size,
                         placement.tp_rank, placement.tp_size, placement.first_layer,
                         placement.end_layer, placement.dtype, self.preferred_dtype)
                self._lost.clear()
                self._registered = True
                return placement
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED):
                    log.error("registration refused: %s", exc.details())
                    return None
                if first and time.monotonic() > deadline:
                    log.error("scheduler %s unreachable for %.0fs", cfg.scheduler_address,
                              cfg.register_timeout_s)
                    return None
                time.sleep(0.5)
        return None

    def _load(self, placement: control_pb2.RegisterResponse,
              link: "ParallelGroups | None") -> "ModelRunner | None":  # noqa: F821
        from worker_svc.model.tensor_parallel import TpGroup, TpShard
        from worker_svc.runner import ModelRunner

        cfg = self.config
        model = load_model_config(cfg.model_path)
        tp = None
        if placement.tp_size > 1:
            assert link is not None and link.tp_group is not None
            try:
                shard = TpShard.build(placement.tp_rank, placement.tp_size, model.num_heads,
                                      model.num_kv_heads, model.intermediate_size,
                                      model.vocab_size)
            except ValueError as exc:
                log.error("cannot shard %s: %s", model.name, exc)
                return None
            tp = TpGroup(link.tp_group, shard)
            log.info("tp_rank %d/%d holds query heads [%d, %d), KV heads [%d, %d), MLP "
                     "columns [%d, %d), vocabulary rows [%d, %d)", placement.tp_rank,
                     placement.tp_size, *shard.q_heads, *shard.kv_heads, *shard.intermediate,
                     *shard.vocab)
        started = time.monotonic()
        try:
            dtype = dtype_for(cfg.device, placement.dtype)
        except DeviceError as exc:
            log.error("cannot serve this replica: %s", exc)
            return None
        runner = ModelRunner(model, cfg.model_path, dtype, cfg.worker_id,
                             first_layer=placement.first_layer, end_layer=placement.end_layer,
                             is_last_stage=placement.pp_rank == placement.pp_size - 1,
                             quant_kernels=cfg.quant_kernels, tp=tp,
                             cpu_level=cfg.cpu_level, device=cfg.device,
                             enforce_eager=cfg.enforce_eager,
                             fail_request_prefix=cfg.fail_request_prefix,
                             kv_store=cfg.kv_store)
        if cfg.fail_request_prefix is not None:
            log.warning("test fault injection on: steps with a request id starting with %r "
                        "fail", cfg.fail_request_prefix)
        self._saver = runner.kv_saver
        log.info("loaded layers [%d, %d) in %.1fs (%.2f GiB of weights)", placement.first_layer,
                 placement.end_layer, time.monotonic() - started,
                 runner.weight_bytes / (1 << 30))
        return runner

    def _capacity(self, runner: "ModelRunner", placement: control_pb2.RegisterResponse  # noqa: F821
                  ) -> int:
        """Blocks this worker can hold, from measured memory (logged term by term)."""
        cfg = self.config
        budget = runner.measure_kv_budget(
            placement.block_size, placement.max_num_batched_tokens or 2048,
            placement.max_num_seqs or 256, cfg.kv_cache_bytes, cfg.gpu_memory_utilization)
        per_block = runner.kv_bytes_per_block(placement.block_size)
        num_blocks = budget.num_blocks(per_block)
        log.info("%s; fits %d blocks of %d tokens (%d bytes each)", budget.describe(),
                 num_blocks, placement.block_size, per_block)
        return num_blocks

    def _serve(self, runner: "ModelRunner", num_blocks: int,  # noqa: F821
               steps: Receiver[ToWorker], outputs: Sender,
               placement: control_pb2.RegisterResponse, link: "ParallelGroups | None",  # noqa: F821
               ) -> None:
        """The step loop. With overlap (CUDA, one pipeline stage), a step's output is read
        only after the next step is launched or the GPU is done with it, whichever comes
        first: the GPU then has the next step queued while the host waits, copies and sends
        (see worker_svc.runner). Outputs leave in step order either way."""
        cfg = self.config
        overlap = cfg.overlap_steps
        if overlap is None:
            overlap = cfg.device.type == "cuda"
        overlap = overlap and placement.pp_size == 1
        pending: LaunchedStep | None = None
        loads: deque[LoadTicket] = deque()   # steps' KV loads, reported once done, in order
        while not self._stop.is_set() and not self._lost.is_set():
            while loads and loads[0].done:
                outputs.send(loads.popleft().report(cfg.worker_id))
            message = steps.recv(timeout_ms=0 if pending is not None else 2 if loads else 200)
            if message is None:
                if pending is not None:
                    if pending.ready():
                        self._finish_step(runner, pending, outputs, placement, link)
                        pending = None
                    else:
                        time.sleep(20e-6)
                continue
            if pending is not None and not isinstance(message, StepInput):
                self._finish_step(runner, pending, outputs, placement, link)
                pending = None
            if isinstance(message, InitCache):
                self._init_cache(runner, message, num_blocks, outputs, placement)
            elif isinstance(message, StepInput):
                try:
                    launched = launch_stage(runner, message, link)
                except Exception as exc:
                    if pending is not None:
                        self._finish_step(runner, pending, outputs, placement, link)
                        pending = None
                    self._send_failure(runner, message, exc, outputs, link)
                    continue
                if pending is not None:
                    self._finish_step(runner, pending, outputs, placement, link)
                    pending = None
                if launched.loads is not None:
                    loads.append(launched.loads)
                if link is not None and link.next_rank is not None:
                    continue                      # forwarded: this stage is done with it
                if overlap:
                    pending = launched
                else:
                    self._finish_step(runner, launched, outputs, placement, link)
        if pending is not None:
            self._finish_step(runner, pending, outputs, placement, link)
        log.info("worker %s %s", cfg.worker_id,
                 "stopping" if self._stop.is_set() else "leaving its replica")

    def _init_cache(self, runner: "ModelRunner", message: InitCache,  # noqa: F821
                    num_blocks: int, outputs: Sender,
                    placement: control_pb2.RegisterResponse) -> None:
        """Allocate the replica's KV cache, or refuse (WorkerFailure: the replica does not come
        up, and the scheduler logs why) a size this worker cannot hold: a cache past the
        measured budget would fail later, mid-step, or take the host's memory."""
        cfg = self.config
        problem = None
        if message.block_size != placement.block_size:
            problem = (f"InitCache block size {message.block_size} differs from the "
                       f"registration's {placement.block_size}")
        elif not 2 <= message.num_blocks <= num_blocks:
            problem = (f"InitCache asks for {message.num_blocks} KV blocks; this worker holds "
                       f"2..{num_blocks} (its budget: --kv-cache-memory-gib on a CPU, "
                       f"--gpu-memory-utilization on a GPU; the scheduler's --num-kv-blocks)")
        if problem is None:
            try:
                runner.init_cache(message.num_blocks, message.block_size,
                                  placement.max_num_seqs or 256)
            except (RuntimeError, ValueError) as exc:     # torch's out-of-memory included
                problem = f"allocating {message.num_blocks} KV blocks failed: {exc}"
        if problem is not None:
            log.error("%s", problem)
            outputs.send(WorkerFailure(worker_id=cfg.worker_id, step_id=0,
                                       message=problem[:4000]))
            return
        log.info("KV cache allocated: %d blocks of %d tokens (replica-wide choice; this worker "
                 "fits %d)", message.num_blocks, message.block_size, num_blocks)
        outputs.send(CacheReady(worker_id=cfg.worker_id, num_blocks=message.num_blocks))

    def _send_failure(self, runner: "ModelRunner", step: StepInput, exc: Exception,  # noqa: F821
                      outputs: Sender, link: "ParallelGroups | None") -> None:  # noqa: F821
        log.error("step %d failed", step.step_id, exc_info=exc)
        if link is None:
            outputs.send(runner.failed_output(step, exc))
        else:
            from worker_svc.parallel import PeerLost

            outputs.send(WorkerFailure(worker_id=self.config.worker_id, step_id=step.step_id,
                                       message=f"{type(exc).__name__}: {exc}"[:4000],
                                       peer_lost=isinstance(exc, PeerLost)))

    def _finish_step(self, runner: "ModelRunner", launched: "LaunchedStep",  # noqa: F821
                     outputs: Sender, placement: control_pb2.RegisterResponse,
                     link: "ParallelGroups | None") -> None:  # noqa: F821
        """Wait for a launched last-stage step; the replica's reporting rank sends it."""
        try:
            result = runner.finish(launched)
        except Exception as exc:
            self._send_failure(runner, launched.step, exc, outputs, link)
            return
        if placement.tp_rank == 0:
            outputs.send(result)

    def _heartbeat(self, control: control_pb2_grpc.WorkerControlStub) -> None:
        """Every second while registered; runs for the life of the process."""
        cfg = self.config
        failing = False
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            if not self._registered or self._lost.is_set():
                continue
            saver = self._saver
            request = control_pb2.HeartbeatRequest(
                worker_id=cfg.worker_id, epoch=self.epoch,
                num_kv_chunks_stored=0 if saver is None else saver.num_chunks_stored,
                num_kv_saves_skipped=0 if saver is None else saver.num_saves_skipped)
            try:
                known = control.Heartbeat(request, timeout=HEARTBEAT_RPC_TIMEOUT_S,
                                          metadata=self._metadata).known
            except grpc.RpcError as exc:
                if not failing:
                    log.warning("heartbeat failed (%s); serving on and retrying",
                                exc.code().name)
                failing = True
                continue
            if failing:
                log.info("scheduler reachable again")
                failing = False
            if not known:
                self._lost.set()
            elif cfg.health_file:
                Path(cfg.health_file).touch()


def kv_slice_to_pb(runner: "ModelRunner") -> control_pb2.KvSlice | None:  # noqa: F821
    """The runner's part of the KV in the store, when it saves and loads there."""
    if runner.kv_loader is None:
        return None
    s = runner.kv_slice()
    return control_pb2.KvSlice(model=s.model, dtype=s.dtype, layer_start=s.layer_start,
                               layer_end=s.layer_end, head_start=s.head_start,
                               head_end=s.head_end)
