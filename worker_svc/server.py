"""The worker process's protocol with the scheduler: registration, capacity report, heartbeats,
and one step loop per registration. `python -m worker_svc` (worker_svc.__main__) builds a
`WorkerServer` from its `WorkerConfig` and calls `run`.

The shard this worker serves and its KV cache belong to worker_svc.placement; the step loop
(receive, launch, send in step order) to worker_svc.step_loop. Only the last pipeline stage's
tp_rank 0 answers steps; every rank answers InitCache so the scheduler knows the whole replica
allocated its KV tensors.

`WorkerConfig.fail_request_prefix` (`SPLITSERVE_TEST_FAIL_REQUEST_PREFIX`, for end-to-end tests
only): every step holding a request whose id starts with it raises before its forward.

Heartbeats start right after registration (a load can take a while) and run on their own
thread. While the scheduler is unreachable the worker keeps running and keeps trying. When a
heartbeat is answered "unknown" (the scheduler restarted, or took this worker's replica down
because a peer was lost) the step loop ends and the worker registers again with a new epoch:
a new member, placed afresh; its loaded shard is kept when the placement is the same.
"""

import logging
import signal
import threading
import time
from pathlib import Path

import grpc
import torch
import zmq

from services import heap
from services.channels import Receiver, Sender
from services.cluster_token import call_metadata
from services.codec import Codec
from services.cpus import available_cpus
from services.grpc_server import CHANNEL_OPTIONS
from services.kv_chunks import KvSlice
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import control_pb2, control_pb2_grpc
from services.wire import FromWorker, ToWorker
from worker_svc.config import WorkerConfig
from worker_svc.device import describe as describe_device
from worker_svc.device import device_label, device_uuid
from worker_svc.placement import Placer
from worker_svc.step_loop import StepLoop

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_RPC_TIMEOUT_S = 2.0


class WorkerServer:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.epoch = config.epoch        # this incarnation's; a re-registration takes a new one
        self._stop = threading.Event()
        self._lost = threading.Event()   # the scheduler no longer knows this incarnation
        self._registered = False         # heartbeats are sent only while registered
        self._metadata = call_metadata(config.cluster_token)
        self.placer = Placer(config)     # the loaded shard, kept across registrations

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
            self.placer.drop()
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
            placed = self.placer.place(placement, link)
            if placed is None:
                return 1
            runner, num_blocks = placed
            heap.settle()                # the shard is loaded: what is left is the step path
            try:
                kv_slice = None if runner.kv_loader is None else runner.kv_slice()
                report = control_pb2.CapacityReport(
                    worker_id=cfg.worker_id, epoch=self.epoch, num_kv_blocks=num_blocks,
                    kv_bytes_per_block=runner.kv_bytes_per_block(placement.block_size),
                    kv_store_slice=kv_slice_to_pb(kv_slice))
                control.ReportCapacity(report, timeout=10.0, metadata=self._metadata)
            except grpc.RpcError as exc:
                log.warning("capacity report failed (%s); registering again", exc.code().name)
                self._lost.set()
                return None
            overlap = cfg.overlap_steps
            if overlap is None:
                # The null model emulates a GPU's queue: it launches ahead as one does.
                overlap = cfg.device.type == "cuda" or cfg.null_model is not None
            outputs = Sender(ctx, Codec(FromWorker), placement.output_address)
            try:
                StepLoop(runner, outputs, placement, link, cfg.worker_id,
                         overlap=overlap and placement.pp_size == 1,
                         init_cache=lambda message: self.placer.init_cache(
                             runner, message, num_blocks, outputs, placement),
                         ).run(steps, self._stop, self._lost)
            finally:
                outputs.close()
            return None
        finally:
            self._registered = False
            if link is not None:
                link.close()

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

    def _heartbeat(self, control: control_pb2_grpc.WorkerControlStub) -> None:
        """Every second while registered; runs for the life of the process."""
        cfg = self.config
        failing = False
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            if not self._registered or self._lost.is_set():
                continue
            saver = self.placer.kv_saver
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


def kv_slice_to_pb(s: KvSlice | None) -> control_pb2.KvSlice | None:
    """A runner's part of the KV in the store (None: it neither saves nor loads there)."""
    if s is None:
        return None
    return control_pb2.KvSlice(model=s.model, dtype=s.dtype, layer_start=s.layer_start,
                               layer_end=s.layer_end, head_start=s.head_start,
                               head_end=s.head_end)
