"""The HTTP listener of the scheduler's Prometheus metrics: GET /metrics, nothing else, and
never more than a few connections' worth of threads.

`ThreadingHTTPServer` gives every connection a thread for as long as it stays open and
writes a traceback for every connection that breaks; an outsider holding 200 half-sent
requests held 200 scheduler threads, and closing them wrote 200 tracebacks. Here a connection
waits at most `READ_TIMEOUT_S` for each read, at most `MAX_CONNECTIONS` are served at once (a
connection past the cap is closed at once and logged, rate-limited per peer), and a
connection that breaks is one debug line. Started by `SchedulerMetrics.serve`.
"""

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from services.refusal_log import RefusalLog

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16    # scrapers served at once (Prometheus keeps one or two)
READ_TIMEOUT_S = 5.0    # per read of a request; a scrape sends its request at once


class MetricsHandler(BaseHTTPRequestHandler):
    """Answers GET /metrics with the body `render()` returns; 404 for any other path."""

    render: Callable[[], tuple[bytes, str]]     # (body, content type), set per server
    timeout = READ_TIMEOUT_S                   # socket timeout (StreamRequestHandler)

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        body, content_type = self.render()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass                                     # scrapes every few seconds: no log line


class MetricsServer(ThreadingHTTPServer):
    """A threading HTTP server with a connection cap; `serve_in_background` starts it."""

    daemon_threads = True
    # The listen backlog: socketserver's default of 5 drops the SYNs of a burst of
    # connections, each then retried after 1 s, 3 s, ... (200 connections at once took 20-34 s
    # to open, tests/e2e/test_outsider.py); past the cap they are closed at once anyway.
    request_queue_size = 128

    def __init__(self, host: str, port: int, render: Callable[[], tuple[bytes, str]],
                 max_connections: int = MAX_CONNECTIONS) -> None:
        handler = type("Handler", (MetricsHandler,), {"render": staticmethod(render)})
        super().__init__((host, port), handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refusals = RefusalLog(log, "metrics connections (over the cap of "
                                   f"{max_connections})")

    def serve_in_background(self) -> int:
        """Serves on a daemon thread; returns the bound port."""
        threading.Thread(target=self.serve_forever, name="metrics", daemon=True).start()
        return int(self.server_port)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refusals.refused(str(client_address[0]), "every connection slot is taken")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)   # starts its thread
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper that went away or stalled past the timeout: nothing worth a traceback.
        log.debug("metrics connection from %s ended early", client_address[0], exc_info=True)

    def shutdown_request(self, request: socket.socket) -> None:
        try:
            super().shutdown_request(request)
        except OSError:
            pass
