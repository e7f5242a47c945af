"""Generated gRPC stubs for proto/splitserve/v1 (checked in; `python -m services.rpc.regen`)."""
