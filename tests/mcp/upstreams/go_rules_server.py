"""An MCP server that reads its messages the way a Go server on `encoding/json` does: the
differential reader once-proxy is tested against beside the Python and TypeScript SDKs.

Go's documented rules, as far as they bear on routing a message (`encoding/json`, Go 1.22):

- Over stdio a `json.Decoder` reads one value after another from the byte stream: a value may
  span several lines, and several values may share one; whitespace (`\\n`, `\\r`, tabs, spaces)
  between them is skipped.
- A struct field is matched by its name exactly or, failing that, case-insensitively under
  Unicode simple case folding (`"paramſ"` is `params`, `"\\u212aey"` is `key`); when several keys
  of an object match one field, the last one wins.
- Invalid UTF-8 and lone surrogate escapes in strings become U+FFFD instead of an error; NaN,
  Infinity and numbers beyond a float64 are errors.

It offers `place_order` (each call appends a line, with the request's id, to the file
`ORDERS_EFFECTS` names) and `get_order`, over stdio or, with `--http PORT`, over stateless
Streamable HTTP (one JSON answer per POST)."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

EFFECTS = Path(os.environ.get("ORDERS_EFFECTS", "/dev/null"))
LOCK = threading.Lock()


def go_fold(name: str) -> str:
    """A name as Go's field matching compares it: each character mapped one to one under
    simple case folding (full folding's multi-character results, like `ß` to `ss`, are not
    Go's; `İ`, whose lower case is `i` and a combining dot, is `i`)."""
    out = []
    for c in name:
        upper = c.upper()
        upper = upper if len(upper) == 1 else c
        lower = upper.lower()
        if len(lower) == 2 and "\u0300" <= lower[1] <= "\u036f":
            lower = lower[0]
        out.append(lower if len(lower) == 1 else upper)
    return "".join(out)


class Obj(list):
    """A decoded object: its members, in order, duplicates kept."""


def field(pairs, name: str):
    """The value Go decodes into the struct field `name` from an object's `pairs`: the last key
    that is `name` or folds to it."""
    if not isinstance(pairs, Obj):
        return None
    found = None
    for key, value in pairs:
        if key == name or go_fold(key) == go_fold(name):
            found = value
    return found


def _no_constants(word: str):
    raise ValueError(f"{word} is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} overflows a float64")
    return value


def _repair(value):
    """Lone surrogates become U+FFFD, as Go decodes them."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list) and not isinstance(value, Obj):
        return [_repair(v) for v in value]
    return value


def _pairs(pairs):
    return Obj((_repair(k), _repair(v)) for k, v in pairs)


DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_no_constants, parse_float=_float)


def decode(text: str):
    """One JSON value from `text` under Go's rules (objects as lists of pairs)."""
    value, end = DECODER.raw_decode(text)
    if text[end:].strip(" \t\r\n"):
        raise ValueError("invalid character after top-level value")
    return _repair(value)


def plain(value):
    """A decoded value as ordinary JSON (the last of duplicate keys wins, as in Go)."""
    if isinstance(value, Obj):
        return {k: plain(v) for k, v in value}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def handle(message):
    """The answer to one decoded message, or None."""
    method = field(message, "method")
    request_id = field(message, "id")
    params = field(message, "params")
    if not isinstance(method, str):
        return None
    if method == "initialize":
        result = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                  "serverInfo": {"name": "orders-go-rules", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [
            {"name": "place_order", "description": "Place an order: charges the customer.",
             "inputSchema": {"type": "object", "properties": {"order_id": {"type": "string"},
                                                               "amount_cents": {"type": "integer"}}}},
            {"name": "get_order", "description": "Look an order up.", "annotations": {"readOnlyHint": True},
             "inputSchema": {"type": "object", "properties": {"order_id": {"type": "string"}}}},
        ]}
    elif method == "tools/call":
        name = field(params, "name")
        arguments = field(params, "arguments")
        order_id = field(arguments, "order_id")
        if name == "place_order":
            with LOCK, EFFECTS.open("a") as effects:
                effects.write(json.dumps({"order_id": order_id, "amount_cents": field(arguments, "amount_cents"),
                                          "key": "", "pid": os.getpid(), "request_id": request_id}) + "\n")
            text = f"order {order_id} placed"
        elif name == "get_order":
            text = "no such order"
        else:
            return {"jsonrpc": "2.0", "id": request_id, "error": {"code": -32602, "message": f"no tool {name}"}}
        result = {"content": [{"type": "text", "text": text}], "isError": False}
    elif method == "ping":
        result = {}
    elif request_id is None:
        return None
    else:
        return {"jsonrpc": "2.0", "id": request_id, "error": {"code": -32601, "message": "method not found"}}
    if request_id is None:
        return None
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def serve_stdio() -> None:
    """A json.Decoder over stdin: values read one after another, across lines. After a syntax
    error the rest of the line is skipped (a Go server would close the stream; reading on finds
    more of what it could have read)."""
    stream = sys.stdin.buffer
    buffer = ""
    while True:
        chunk = stream.readline()
        if not chunk:
            return
        buffer += chunk.decode("utf-8", "replace")
        if len(buffer) > 1 << 20:
            buffer = ""
        while True:
            stripped = buffer.lstrip(" \t\r\n")
            if not stripped:
                buffer = ""
                break
            try:
                value, end = DECODER.raw_decode(stripped)
            except ValueError as error:
                if "Expecting" in str(error) and error.pos >= len(stripped.rstrip("\r\n")):
                    buffer = stripped  # the value goes on after this line
                    break
                buffer = stripped.split("\n", 1)[1] if "\n" in stripped else ""
                continue
            buffer = stripped[end:]
            answer = handle(_repair(value))
            if answer is not None:
                sys.stdout.write(json.dumps(answer) + "\n")
                sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        try:
            message = decode(body.decode("utf-8", "replace"))
        except ValueError as error:
            return self.answer(400, {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": str(error)}})
        answer = handle(message)
        if answer is None:
            self.send_response(202)
            self.end_headers()
            return None
        return self.answer(200, answer)

    def answer(self, status: int, message) -> None:
        data = json.dumps(message).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


if __name__ == "__main__":
    if "--http" in sys.argv:
        port = int(sys.argv[sys.argv.index("--http") + 1])
        ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    else:
        serve_stdio()
