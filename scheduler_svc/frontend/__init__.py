"""The scheduler's front ends: the client gRPC API (and, through it, the HTTP front end's),
tokenizing, incremental detokenizing, stop strings, the client streams, request metrics, and
routing each request to a replica's engine core. Several front-end processes share the client
port (`--frontends N`); each gets only its own requests' slice of each step message."""
