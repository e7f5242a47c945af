"""The engine core: one process per replica (scheduling, the plan client, the step sockets,
token-level stops, block hashes). No text, no protobuf, no client streams: requests come in
from the front ends as token ids, and each step's outputs go back to them packed, one message
per front end (scheduler_svc.engine.wire)."""
