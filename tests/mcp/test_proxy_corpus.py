"""The differential corpus (`corpus/`): messages on which JSON parsers disagree, each sent
through once-proxy to the Python SDK's server, the TypeScript SDK's and a reader following Go's
documented rules (`upstreams/go_rules_server.py`), over stdio and Streamable HTTP, on both
ledger backends. What reaches the upstream is recorded (`upstreams/recorder.py`).

For every message: the proxy's verdict is the one its file name gives (`refused-parse-…`,
`refused-…`, `dropped-…`, `guarded-…`, `passed-…`); a refused one reaches no upstream; what does
reach one is the proxy's re-serialisation, which the Python, Go and strict readers all read as
the same message, and a guarded call reaches it under the proxy's own id. In the end every effect
came in under one of the proxy's ids, once per guarded message, and each has its operation in
the ledger: zero effects without a ledger operation."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import BIN, free_port, make_stack, served_port, wait_for
from test_proxy import HTTP_SERVING, RawSession, SESSION, UPSTREAMS, upstream_command

sys.path.insert(0, str(UPSTREAMS))
import go_rules_server  # noqa: E402

CORPUS = sorted((Path(__file__).resolve().parent / "corpus").glob("*.jsonrpc"))
RECORDER = UPSTREAMS / "recorder.py"

POLICY = """
[tools.place_order]
intent = ["order", "{/order_id}"]
volatile = ["note"]
timeout = "30s"
"""


def verdict(entry: Path) -> str:
    for kind in ("refused-parse", "refused", "dropped", "guarded", "passed"):
        if entry.name.startswith(kind + "-"):
            return kind
    raise AssertionError(f"{entry.name}: name it by its verdict")


def command(upstream: str) -> list[str]:
    if upstream == "go":
        return [sys.executable, str(UPSTREAMS / "go_rules_server.py")]
    return upstream_command(upstream)


def strict(line: bytes):
    """The value of a line the upstream received, checked to be what no two parsers read
    differently: ASCII, one value, no duplicate names, no NaN; and Go's reader reads the same."""
    assert line.isascii(), line
    assert b"\r" not in line and b"\n" not in line, line

    def pairs(items):
        names = [k for k, _ in items]
        assert len(names) == len(set(names)), f"duplicate names in {line!r}"
        return dict(items)

    def constant(word):
        raise AssertionError(f"{word} in {line!r}")

    value = json.loads(line, object_pairs_hook=pairs, parse_constant=constant)
    assert go_rules_server.plain(go_rules_server.decode(line.decode())) == value, line
    return value


def order_of(entry: Path) -> str | None:
    message = json.loads(entry.read_bytes())
    return message["params"]["arguments"]["order_id"]


def literal(text: bytes):
    """A JSON text's value with its numbers as they are written, to compare number texts."""
    return json.loads(text, parse_int=str, parse_float=str)


def check_forwarded(entry: Path, forwarded: list[bytes]) -> None:
    """What reached the upstream for `entry`, against its verdict; numbers must arrive as they
    were written."""
    kind = verdict(entry)
    values = [strict(line) for line in forwarded]
    texts = [literal(line) for line in forwarded]
    if kind in ("refused-parse", "refused", "dropped"):
        assert values == [], f"{entry.name} reached the upstream: {forwarded}"
    elif kind == "passed":
        assert values == [json.loads(entry.read_bytes())], f"{entry.name}: {forwarded}"
        assert texts == [literal(entry.read_bytes())], f"{entry.name}: {forwarded}"
    else:
        sent = json.loads(entry.read_bytes())
        assert len(values) == 1, f"{entry.name}: {forwarded}"
        (call,) = values
        assert call["id"].startswith("once-proxy:"), call
        assert call["method"] == "tools/call" and call["params"]["name"] == "place_order", call
        assert call["params"]["arguments"] == sent["params"]["arguments"], call
        assert texts[0]["params"]["arguments"] == literal(entry.read_bytes())["params"]["arguments"], forwarded
        if "_meta" in sent["params"]:
            assert call["params"]["_meta"]["progressToken"] == call["id"], call


def check_answer(entry: Path, answers: list) -> None:
    """The proxy's answers to `entry`, against its verdict."""
    kind = verdict(entry)
    if kind == "refused-parse":
        assert answers and all(a["id"] is None and a["error"]["code"] == -32700 for a in answers), (entry.name, answers)
    elif kind == "refused":
        (answer,) = answers
        for one in answer if isinstance(answer, list) else [answer]:
            assert one["error"]["code"] == -32600, (entry.name, answer)
            # A look-alike name is refused for being one, not for anything else about it.
            if entry.name.startswith("refused-key-"):
                assert "lenient reader takes it" in one["error"]["message"], (entry.name, answer)
    elif kind == "dropped":
        assert answers == [], (entry.name, answers)
    elif kind == "guarded":
        (answer,) = answers
        texts = " ".join(block["text"] for block in answer["result"]["content"])
        assert f"order {order_of(entry)} placed" in texts, (entry.name, answer)


def expected_id(entry: Path):
    """The id the proxy answers `entry` under, for the verdicts that answer under one."""
    message = json.loads(entry.read_bytes())
    if isinstance(message, list) and message:
        return "batch"
    id = message.get("id") if isinstance(message, dict) else None
    if isinstance(id, str) and id.startswith("once-proxy:") or not isinstance(id, (str, int, float)):
        return None
    return id


def check_effects(orders_effects: Path, stack) -> None:
    lines = orders_effects.read_text().splitlines() if orders_effects.exists() else []
    placed = [effect for effect in map(json.loads, filter(str.strip, lines)) if "order_id" in effect]
    guarded = sorted(order_of(e) for e in CORPUS if verdict(e) == "guarded")
    assert sorted(o["order_id"] for o in placed) == guarded, placed
    assert all(str(o["request_id"]).startswith("once-proxy:") for o in placed), placed
    listed = subprocess.run(
        [str(BIN / "oncectl"), "list", "--all", "--json", "--limit", "1000", "--addr", f"http://127.0.0.1:{stack.ledger_port}"],
        capture_output=True, text=True, check=True)
    operations = json.loads(listed.stdout)["operations"]
    assert len(operations) == len(guarded) and all(op["state"] == "CONFIRMED" for op in operations), operations


@pytest.fixture(params=["python", "typescript", "go"])
def upstream(request):
    return request.param


@pytest.fixture
def corpus_ledger(tmp_path, backend):
    """A ledger, the corpus's policy beside it (`policy.toml`), and the file the upstream's
    effects go to (`effects.jsonl`)."""
    stack = make_stack(tmp_path, backend, "none", reconcile=False)
    (tmp_path / "policy.toml").write_text(POLICY)
    try:
        yield stack
    finally:
        stack.close()


def test_the_corpus_over_stdio(tmp_path, corpus_ledger, upstream):
    stack = corpus_ledger
    policy, effects, received = tmp_path / "policy.toml", tmp_path / "effects.jsonl", tmp_path / "received"
    received.touch()
    proxy = [str(BIN / "once-proxy"), "--policy", str(policy), "--ledger", f"http://127.0.0.1:{stack.ledger_port}",
             "--", sys.executable, str(RECORDER), "stdio", str(received), "--", *command(upstream)]
    with RawSession(proxy, {"ORDERS_EFFECTS": str(effects)}) as session:
        session.send(SESSION[0])
        session.answer_to(1)
        session.send(SESSION[1])
        session.send({"jsonrpc": "2.0", "id": "ready", "method": "ping"})
        session.answer_to("ready")
        for n, entry in enumerate(CORPUS):
            raw = entry.read_bytes()
            mark, seen = received.stat().st_size, len(session.seen)
            session.send(raw)
            kind = verdict(entry)
            answers = []
            if kind == "refused-parse":
                answers = [session.answer() for _ in range(raw.count(b"\n") + 1)]
            elif kind in ("refused", "guarded") or (kind == "passed" and expected_id(entry) is not None):
                want = expected_id(entry)
                while True:
                    answer = session.answer()
                    if want == "batch" and isinstance(answer, list) or isinstance(answer, dict) and answer.get("id") == want:
                        answers.append(answer)
                        break
            sentinel = f"sentinel-{n}"
            session.send({"jsonrpc": "2.0", "id": sentinel, "method": "ping"})
            session.answer_to(sentinel)
            # Nothing came back but the answers waited for, the sentinel's, and progress
            # under the client's own token.
            extra = [m for m in session.seen[seen:-1] if m not in answers]
            for progress in [m for m in extra if isinstance(m, dict) and m.get("method") == "notifications/progress"]:
                assert progress["params"]["progressToken"] == json.loads(raw)["params"]["_meta"]["progressToken"], progress
                extra.remove(progress)
            assert extra == [], (entry.name, extra)
            if kind != "passed":
                check_answer(entry, answers)
            lines = received.read_bytes()[mark:].splitlines()
            assert lines and json.loads(lines[-1])["id"] == sentinel, (entry.name, lines)
            check_forwarded(entry, lines[:-1])
    check_effects(effects, stack)


def post(port: int, body: bytes, session: str | None) -> tuple[int, list, str | None]:
    """POSTs `body` to the proxy: its status, the JSON-RPC messages it answered with, and the
    session id it gave."""
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": "2025-11-25"}
    if session:
        headers["mcp-session-id"] = session
    request = urllib.request.Request(f"http://127.0.0.1:{port}/mcp", method="POST", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status, kind, data, session_id = answer.status, answer.headers.get("content-type", ""), answer.read(), answer.headers.get("mcp-session-id")
    except urllib.error.HTTPError as error:
        status, kind, data, session_id = error.code, error.headers.get("content-type", ""), error.read(), None
    if kind.startswith("text/event-stream"):
        messages = [json.loads(line[5:]) for line in data.decode().splitlines() if line.startswith("data:")]
    elif kind.startswith("application/json") and data:
        messages = [json.loads(data)]
    else:
        messages = []
    return status, messages, session_id


def test_the_corpus_over_http(tmp_path, corpus_ledger, upstream):
    stack = corpus_ledger
    policy, effects, received = tmp_path / "policy.toml", tmp_path / "effects.jsonl", tmp_path / "received.jsonl"
    received.touch()
    env = {**os.environ, "ORDERS_EFFECTS": str(effects)}
    upstream_port, recorder_port = free_port(), free_port()
    stack.spawn_logged([*command(upstream), "--http", str(upstream_port)], tmp_path / "upstream.log", env=env)
    stack.spawn_logged([sys.executable, str(RECORDER), "http", str(received), str(recorder_port),
                        f"http://127.0.0.1:{upstream_port}/mcp"], tmp_path / "recorder.log", env=env)
    # Both listen before the proxy asks for a port of its own: otherwise it may be given one of
    # theirs, which the test chose but they had not bound yet.
    for name, taken in (("the upstream", upstream_port), ("the recorder", recorder_port)):
        wait_for(name, lambda taken=taken: socket.create_connection(("127.0.0.1", taken), timeout=1).close() or True,
                 limit=60)
    log = tmp_path / "once-proxy.log"
    stack.spawn_logged([str(BIN / "once-proxy"), "--policy", str(policy),
                        "--ledger", f"http://127.0.0.1:{stack.ledger_port}", "--listen", "127.0.0.1:0",
                        "--upstream", f"http://127.0.0.1:{recorder_port}/mcp"], log)
    port = wait_for("once-proxy", lambda: served_port(log, HTTP_SERVING, 0))

    def initialized():
        status, answers, session = post(port, json.dumps(SESSION[0]).encode(), None)
        return status == 200 and answers and [session]

    (session,) = wait_for("the upstream", initialized)
    post(port, json.dumps(SESSION[1]).encode(), session)
    for entry in CORPUS:
        raw = entry.read_bytes()
        if b"\n" in raw:
            continue  # about stdio's framing; one body over HTTP
        mark = len(received.read_text().splitlines())
        status, messages, _ = post(port, raw, session)
        answers = [m for m in messages if isinstance(m, list) or "method" not in m]
        # Progress reaches the client under its own token, never the proxy's.
        for progress in [m for m in messages if isinstance(m, dict) and m.get("method") == "notifications/progress"]:
            assert progress["params"]["progressToken"] == json.loads(raw)["params"]["_meta"]["progressToken"], progress
        kind = verdict(entry)
        expected_status = {"refused-parse": 400, "refused": 200, "dropped": 202, "guarded": 200}.get(kind)
        if expected_status is not None:
            assert status == expected_status, (entry.name, status, answers)
            check_answer(entry, answers)
        requests = [json.loads(line) for line in received.read_text().splitlines()[mark:]]
        check_forwarded(entry, [base64.b64decode(r["body"]) for r in requests])
    check_effects(effects, stack)
