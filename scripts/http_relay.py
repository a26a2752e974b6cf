"""Relaying one HTTP request to a server: what the proxies in front of an S3 server share.

The benchmarks' DelayProxy (bench_remote.py) and the tests' FaultProxy
(tests/remote_helpers.py) each answer a request by relaying it to the
server behind them, with what each does around that of its own. Not a
benchmark itself: the scripts import it from their own folder, the tests
through the path conftest.py gives them.
"""

from __future__ import annotations

import http.client
import http.server


def relay(handler: http.server.BaseHTTPRequestHandler, upstream: str, body: bytes) -> bytes:
    """Sends the request handler received (its method, path, headers but Connection, and
    body) to upstream (host:port), and the answer's status and headers back through
    handler; returns the answer's body, which the caller writes (none after a HEAD)."""
    method = handler.command
    connection = http.client.HTTPConnection(upstream, timeout=30)
    try:
        headers = {k: v for k, v in handler.headers.items() if k.lower() != "connection"}
        connection.request(method, handler.path, body=body or None, headers=headers)
        answer = connection.getresponse()
        data = answer.read()
    finally:
        connection.close()
    handler.send_response(answer.status)
    for name, value in answer.getheaders():
        if name.lower() not in ("content-length", "connection", "transfer-encoding"):
            handler.send_header(name, value)
    # A HEAD answer has no body: its length is the object's, as the server said.
    length = answer.getheader("Content-Length") if method == "HEAD" else None
    handler.send_header("Content-Length", length or str(len(data)))
    handler.end_headers()
    return data
