"""CORS, off unless `--allowed-origins` names origins: a browser page on another origin then
gets no Access-Control-* headers and no preflight grant, so it cannot call the API (and
http_svc.content_type refuses the bodies it could send without a preflight). With origins
listed, Starlette's CORSMiddleware answers preflights and marks responses for those origins
only; "*" allows any origin. Requests carry API keys in the Authorization header, not cookies,
so credentials (cookies) are never allowed.
"""

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

METHODS = ("GET", "POST", "OPTIONS")
EXPOSED_HEADERS = ("x-request-id",)


def add_cors(app: FastAPI, allowed_origins: tuple[str, ...]) -> None:
    """Adds the CORS middleware for `allowed_origins`; nothing when there are none."""
    if not allowed_origins:
        return
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                       allow_methods=list(METHODS), allow_headers=["*"],
                       expose_headers=list(EXPOSED_HEADERS), allow_credentials=False)
