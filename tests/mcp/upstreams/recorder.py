"""Records what reaches an upstream MCP server, for the tests that check what once-proxy
forwards.

`recorder.py stdio LOG -- COMMAND…` runs COMMAND with this process's stdout and stderr, and
copies every byte of its stdin both to COMMAND and to the file LOG.

`recorder.py http LOG PORT UPSTREAM [--forbid-tool-calls]` is a reverse proxy on 127.0.0.1:PORT
in front of the Streamable HTTP endpoint UPSTREAM: each request is forwarded, and a line of JSON
(method, headers, body) appended to LOG. With `--forbid-tool-calls` it is a gateway that refuses
a `tools/call` with 403 *after* the upstream has answered it: the effect happened, and what the
proxy sees says otherwise."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()


def stdio(log: str, command: list[str]) -> int:
    child = subprocess.Popen(command, stdin=subprocess.PIPE)
    with open(log, "ab") as recorded:
        while True:
            chunk = sys.stdin.buffer.read1(65536)
            if not chunk:
                break
            recorded.write(chunk)
            recorded.flush()
            try:
                child.stdin.write(chunk)
                child.stdin.flush()
            except BrokenPipeError:
                break
    try:
        child.stdin.close()
    except BrokenPipeError:
        pass
    return child.wait()


def http(log: str, port: int, upstream: str, forbid: bool) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def relay(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            with LOCK, open(log, "a") as recorded:
                recorded.write(json.dumps({
                    "method": self.command,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": base64.b64encode(body).decode(),
                }) + "\n")
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
            request = urllib.request.Request(upstream, data=body if body else None, method=self.command, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    status, answer_headers, data = answer.status, answer.headers, answer.read()
            except urllib.error.HTTPError as error:
                status, answer_headers, data = error.code, error.headers, error.read()
            if forbid and b'"tools/call"' in body:
                status, answer_headers, data = 403, {"content-type": "text/plain"}, b"Forbidden"
            self.send_response(status)
            for name, value in answer_headers.items():
                if name.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                    self.send_header(name, value)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_POST = do_DELETE = relay

        def do_GET(self) -> None:
            # No standalone event stream: a recorder that held one open would hold a thread.
            self.send_response(405)
            self.send_header("allow", "POST, DELETE")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    mode, log = sys.argv[1], sys.argv[2]
    if mode == "stdio":
        sys.exit(stdio(log, sys.argv[sys.argv.index("--") + 1:]))
    http(log, int(sys.argv[3]), sys.argv[4], "--forbid-tool-calls" in sys.argv)
