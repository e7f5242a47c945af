"""A gRPC servicer context for the servicers' unit tests (the front end's Generation and the
cluster's WorkerControl): `abort` raises where grpc.aio's would end the call."""

import grpc


class Aborted(Exception):
    """What the fake context raises where grpc.aio's abort would end the call."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class FakeContext:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"
