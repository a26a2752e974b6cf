"""A remote under test for the remote tier's tests: a Remote's URL and raw access, a fault proxy.

Remote names a remote a test uses (an S3 bucket on moto's server or a
file:// directory) with the environment that reaches it and raw object
access for the attacker the tests play; FaultProxy answers chosen requests
itself (403/429/503), delays them, or moves bodies slowly, in front of the
S3 server; Hang never answers; closed_port is a port nothing listens on;
record_fields and record_bytes read and write a record's layout (its
header line, then its JSON body). The fixtures that make them (s3_endpoint,
remote, s3_proxy) are in conftest.py.
"""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import threading
import time
from pathlib import Path


class Remote:
    """A remote under test: its URL, the environment that reaches it, and raw object access."""

    def __init__(self, url: str, env: dict[str, str], root: Path | None, s3=None, bucket=""):
        self.url = url
        self.env = {"PJRT_POOL_CACHE_REMOTE": url, **env}
        self.root = root
        self.s3 = s3
        self.bucket = bucket

    def read(self, name: str) -> bytes:
        if self.root is not None:
            return (self.root / name).read_bytes()
        return self.s3.get_object(Bucket=self.bucket, Key=f"fleet/{name}")["Body"].read()

    def write(self, name: str, data: bytes) -> None:
        """Writes over an object, as an attacker who can write the bucket could."""
        if self.root is not None:
            path = self.root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        else:
            self.s3.put_object(Bucket=self.bucket, Key=f"fleet/{name}", Body=data)

    def delete(self, name: str) -> None:
        """Removes an object, as an attacker (or a lost disk) could."""
        if self.root is not None:
            (self.root / name).unlink()
        else:
            self.s3.delete_object(Bucket=self.bucket, Key=f"fleet/{name}")

    def names(self) -> list[str]:
        if self.root is not None:
            return sorted(
                str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()
            )
        listed = self.s3.list_objects_v2(Bucket=self.bucket).get("Contents", [])
        return sorted(item["Key"].removeprefix("fleet/") for item in listed)


def record_fields(data: bytes) -> dict:
    """The JSON body of a record's bytes (after its header line)."""
    return json.loads(data.split(b"\n", 1)[1])


def record_bytes(fields: dict, signature: str = "-") -> bytes:
    """A record with this body and signature (hex, "-" for none), as a writer lays it out."""
    return f"pjrt-pool remote record 2 {signature}\n".encode() + json.dumps(fields).encode()


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


class Hang(threading.Thread):
    """A server on the loopback that accepts connections and never answers."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.held: list[socket.socket] = []

    def run(self) -> None:
        while True:
            try:
                self.held.append(self.socket.accept()[0])
            except OSError:
                return


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


RESET = 0
"""A FaultProxy fault: the connection is closed without an answer."""
SHORT = 1
"""A FaultProxy fault: the answer's body is cut to half its Content-Length."""


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


class FaultProxy:
    """An HTTP proxy on the loopback in front of the S3 server that answers some requests itself.

    faults: (method, status) pairs, each answered once, in order, to the
    next request of that method (status "always" entries: see always);
    status RESET closes the connection without an answer, and SHORT
    forwards the server's answer with its whole Content-Length but only half
    its body, then closes; every other request goes to the server. pace
    (bytes, seconds) moves bodies of requests and answers of more than that
    many bytes that many at a time, pausing between: a slow but steady link;
    delays maps a part of a request's path to seconds it waits before it is
    forwarded. seen counts requests by method, sent the body bytes the
    server's answers carried.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.faults: list[tuple[str, int]] = []
        self.always: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.sent = 0
        self.answered: list[tuple[str, int]] = []
        self.pace: tuple[int, float] | None = None
        self.delays: dict[str, float] = {}
        proxy = self

        def paced_read(stream, length: int) -> bytes:
            if proxy.pace is None or length <= proxy.pace[0]:
                return stream.read(length)
            parts, step, pause = [], proxy.pace[0], proxy.pace[1]
            while length > 0:
                parts.append(stream.read(min(step, length)))
                length -= len(parts[-1])
                time.sleep(pause)
            return b"".join(parts)

        def paced_write(stream, data: bytes) -> None:
            if proxy.pace is None or len(data) <= proxy.pace[0]:
                stream.write(data)
                return
            step, pause = proxy.pace
            for start in range(0, len(data), step):
                stream.write(data[start : start + step])
                stream.flush()
                time.sleep(pause)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else headers and body wait on delayed ACKs (40 ms)

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                method = self.command
                body = paced_read(self.rfile, int(self.headers.get("Content-Length") or 0))
                proxy.seen[method] = proxy.seen.get(method, 0) + 1
                for part, seconds in proxy.delays.items():
                    if part in self.path:
                        time.sleep(seconds)
                status = proxy.always.get(method)
                for i, (m, s) in enumerate(proxy.faults):
                    if status is None and m == method:
                        status = s
                        del proxy.faults[i]
                        break
                if status is not None:
                    proxy.answered.append((method, status))
                if status == RESET:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if status is not None and status != SHORT:
                    code = {403: "AccessDenied", 429: "SlowDown", 503: "ServiceUnavailable"}
                    text = f"<Error><Code>{code.get(status, 'Fault')}</Code></Error>".encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                    return
                data = relay(self, proxy.upstream, body)
                if method != "HEAD":
                    if status == SHORT:
                        data = data[: len(data) // 2]
                        self.close_connection = True
                    proxy.sent += len(data)  # before: the client may go on once it has it
                    paced_write(self.wfile, data)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _any  # noqa: N815 (http.server's names)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


class RangeServer:
    """A read-only HTTP server on the loopback for a directory, answering ranged GETs (206).

    It gives each file a strong ETag (its size and mtime) and honours If-Match, as object
    stores do; seen counts requests by method and sent the body bytes sent.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: dict[str, int] = {}
        self.sent = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    server.sent += len(body)  # before: the client may go on once it has it
                    self.wfile.write(body)

            def do_GET(self) -> None:
                server.seen[self.command] = server.seen.get(self.command, 0) + 1
                path = server.root / self.path.lstrip("/").split("?")[0]
                if not path.is_file():
                    self._answer(404, {})
                    return
                data = path.read_bytes()
                found = path.stat()
                etag = f'"{found.st_size}-{found.st_mtime_ns}"'
                wanted = self.headers.get("If-Match")
                if wanted is not None and wanted != etag:
                    self._answer(412, {"ETag": etag})
                    return
                given = self.headers.get("Range", "")
                if not given.startswith("bytes="):
                    self._answer(200, {"ETag": etag}, data)
                    return
                first, _, last = given.removeprefix("bytes=").partition("-")
                start = int(first) if first else max(0, len(data) - int(last))
                end = min(int(last), len(data) - 1) if first and last else len(data) - 1
                if start >= len(data):
                    self._answer(416, {"Content-Range": f"bytes */{len(data)}"})
                    return
                headers = {"ETag": etag, "Content-Range": f"bytes {start}-{end}/{len(data)}"}
                self._answer(206, headers, data[start : end + 1])

            do_HEAD = do_GET  # noqa: N815

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
