"""A lean streaming HTTP client, the HTTP twin of the gRPC batch client
(bench/splitserve_runs.py `batch_client_process`): every prompt as one streamed
/v1/completions request at once, over raw asyncio sockets in one process at the clients'
niceness, counting the tokens the server's usage reports.

Why: `vllm bench serve`, the load generator both servers face in bench/http_serving.py, spends
~850 µs of CPU per streamed token on its own (tokenizing, per-chunk bookkeeping); on a 2-core
machine that is a core taken from the server. Against the gRPC client's ~30 µs that compares
clients, not paths. This client reads each event and little else, so HTTP against gRPC
measures what the HTTP front end adds.
"""

import asyncio
import json
import multiprocessing.connection
import os
import time
from urllib.parse import urlsplit

from splitserve_runs import in_child_process

DONE = b"data: [DONE]"


async def _one(host: str, port: int, body: bytes) -> int:
    """One streamed completion; its completion tokens (the final usage chunk's)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP status {status!r}: {(await reader.read(2000))!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
            chunked = True
    tail = b""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)       # the chunk and its CRLF
        else:
            data = await reader.read(65536)
            if not data:
                break
        tail = (tail + data)[-4096:]
        if DONE in tail:
            break
    writer.close()
    usage = tail.rfind(b'"completion_tokens":')
    if usage < 0:
        raise RuntimeError(f"no usage in the stream's end: {tail[-300:]!r}")
    digits = tail[usage + len(b'"completion_tokens":'):].lstrip()
    return int(digits[:len(digits) - len(digits.lstrip(b"0123456789"))])


async def _all(base_url: str, model: str, prompts: list[str], max_tokens: int,
               ) -> tuple[list[int], float]:
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    bodies = [json.dumps({"model": model, "prompt": p, "max_tokens": max_tokens,
                          "temperature": 0, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}).encode()
              for p in prompts]
    began = time.perf_counter()
    counts = await asyncio.gather(*(_one(host, port, b) for b in bodies))
    return list(counts), time.perf_counter() - began


def _child(base_url: str, model: str, prompts: list[str], max_tokens: int, nice: int,
           conn: "multiprocessing.connection.Connection") -> None:
    os.nice(nice)
    cpu = time.process_time()
    counts, wall = asyncio.run(_all(base_url, model, prompts, max_tokens))
    conn.send((counts, wall, time.process_time() - cpu))
    conn.close()


def http_stream_process(base_url: str, model: str, prompts: list[str], max_tokens: int,
                        nice: int) -> tuple[list[int], float, float]:
    """Every prompt streamed at once from a fresh process at niceness `nice`: (tokens per
    prompt, wall seconds from the first request to the last token, the client's CPU
    seconds)."""
    return in_child_process(_child, (base_url, model, prompts, max_tokens, nice),
                            "bench-http-client")
