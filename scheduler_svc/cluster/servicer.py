"""The gRPC adapter of the cluster's control plane: `WorkerControl` (worker registration,
capacity reports, heartbeats) on the internal control listener. Thin by design: protobuf in,
`Membership` called, protobuf out, errors as status codes.
"""

import grpc
import msgspec

from scheduler_svc.cluster.membership import Membership
from scheduler_svc.cluster.placement import RegistrationError
from services.kv_store_wire import KvSlice
from services.kv_wire import future_epoch
from services.rpc.splitserve.v1 import control_pb2, control_pb2_grpc


def kv_slice_from_pb(report: control_pb2.CapacityReport) -> KvSlice | None:
    """The worker's store slice, validated as the wire's (None: it reported none)."""
    if not report.HasField("kv_store_slice"):
        return None
    s = report.kv_store_slice
    try:
        return msgspec.convert(["KvSlice", s.model, s.dtype, s.layer_start, s.layer_end,
                                s.head_start, s.head_end], KvSlice)   # tag, then fields
    except msgspec.ValidationError as exc:
        raise RegistrationError(f"bad kv_store_slice: {exc}") from exc


class WorkerControlServicer(control_pb2_grpc.WorkerControlServicer):
    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    async def Register(self, request: control_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> control_pb2.RegisterResponse:
        if (problem := future_epoch(request.epoch)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker {problem}")
        try:
            p = self.membership.register(request.worker_id, request.epoch, request.device,
                                      request.memory_bytes, request.step_address, request.model,
                                      request.preferred_dtype, request.cpu_level,
                                      request.device_uuid)
        except RegistrationError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        sc = self.membership.sched_config
        return control_pb2.RegisterResponse(
            replica_id=p.replica_id, pp_rank=p.pp_rank, tp_rank=p.tp_rank, pp_size=p.pp_size,
            tp_size=p.tp_size, first_layer=p.first_layer, end_layer=p.end_layer,
            block_size=sc.block_size, output_address=p.output_address,
            dtype=p.dtype, dist_init_method=p.dist_init_method,
            kv_cache_dtype=self.membership.config.kv_cache_dtype,
            quantization=self.membership.config.quantization,
            # The largest step the worker will see: its memory profile and CUDA graphs size
            # from these (token_budget, not the flag: without chunked prefill a whole prompt
            # up to the context length is one step).
            max_num_batched_tokens=sc.token_budget, max_num_seqs=sc.max_num_seqs)

    async def ReportCapacity(self, request: control_pb2.CapacityReport,
                             context: grpc.aio.ServicerContext) -> control_pb2.CapacityAck:
        try:
            self.membership.report_capacity(request.worker_id, request.epoch,
                                            request.num_kv_blocks, kv_slice_from_pb(request))
        except RegistrationError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return control_pb2.CapacityAck()

    async def Heartbeat(self, request: control_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> control_pb2.HeartbeatResponse:
        return control_pb2.HeartbeatResponse(
            known=self.membership.heartbeat(request.worker_id, request.epoch,
                                            request.num_kv_chunks_stored,
                                            request.num_kv_saves_skipped))
