"""once-proxy in front of an MCP server that knows nothing of the ledger (the Python SDK's
MCPServer or the standalone FastMCP, `upstreams/orders_server.py`, and the TypeScript SDK's,
`upstreams/ts`), driven by the official Python MCP SDK over stdio and Streamable HTTP, on SQLite
and PostgreSQL. The upstream counts its side effects in a file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta
from pathlib import Path

import anyio
import pytest
from mcp import Client, ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from conftest import BIN, Process, free_port, make_stack, served_port, wait_for

pytestmark = pytest.mark.anyio

UPSTREAMS = Path(__file__).resolve().parent / "upstreams"
UPSTREAM = UPSTREAMS / "orders_server.py"
# The same server in TypeScript on the official TypeScript SDK, run by Node through tsx.
TS_UPSTREAM = [str(UPSTREAMS / "ts" / "node_modules" / ".bin" / "tsx"), str(UPSTREAMS / "ts" / "orders_server.ts")]


def upstream_command(language: str) -> list[str]:
    """The orders server on the Python SDK's MCPServer ("python"), on the standalone FastMCP
    package ("fastmcp"), or on the TypeScript SDK ("typescript")."""
    return {
        "python": [sys.executable, str(UPSTREAM)],
        "fastmcp": [sys.executable, str(UPSTREAM), "--framework", "fastmcp"],
        "typescript": TS_UPSTREAM,
    }[language]

POLICY = """
status_tool = "get_order"
annotate = true

[tools.place_order]
intent = ["order", "{/order_id}"]
volatile = ["note"]
lease = "2s"
timeout = "30s"
"""


class Orders:
    """One ledger and the proxy's files: its policy, the upstream's effects."""

    def __init__(self, stack, tmp: Path, language: str = "python"):
        self.stack = stack
        self.command = upstream_command(language)
        self.tmp = tmp
        self.effects = tmp / "effects.jsonl"
        self.hold = tmp / "hold"
        self.policy = tmp / "policy.toml"
        self.policy.write_text(POLICY)
        # The proxy's own flags besides the policy and the ledger.
        self.flags: list[str] = []

    def lines(self) -> list[dict]:
        if not self.effects.exists():
            return []
        return [json.loads(line) for line in self.effects.read_text().splitlines() if line.strip()]

    def placed(self, order_id: str | None = None) -> list[dict]:
        orders = [o for o in self.lines() if "order_id" in o]
        return [o for o in orders if order_id is None or o["order_id"] == order_id]

    def cancelled(self) -> list[str]:
        return [line["cancelled"] for line in self.lines() if "cancelled" in line]

    def params(self) -> StdioServerParameters:
        return StdioServerParameters(
            command=str(BIN / "once-proxy"),
            args=[
                "--policy", str(self.policy),
                "--ledger", f"http://127.0.0.1:{self.stack.ledger_port}",
                *self.flags,
                "--", *self.command,
            ],
            env={"ORDERS_EFFECTS": str(self.effects), "ORDERS_HOLD": str(self.hold)},
        )

    def raw(self) -> "RawSession":
        """A raw stdio session with the proxy in front of the upstream."""
        params = self.params()
        return RawSession([params.command, *params.args], params.env)

    @contextlib.asynccontextmanager
    async def session(self):
        with open(self.tmp / "once-proxy.log", "a") as errlog:
            async with stdio_client(self.params(), errlog=errlog) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    yield session


@pytest.fixture(params=["python", "fastmcp", "typescript"])
def orders(tmp_path, backend, request):
    """A ledger, and once-proxy over stdio in front of one of the upstreams."""
    assert (BIN / "once-proxy").exists(), f"{BIN / 'once-proxy'} is missing: run cargo build --workspace first"
    assert Path(TS_UPSTREAM[0]).exists(), "the TypeScript upstream's packages are missing: run make test"
    stack = make_stack(tmp_path, backend, "none", reconcile=False)
    try:
        yield Orders(stack, tmp_path, request.param)
    finally:
        stack.close()


def texts(result) -> list[str]:
    return [block.text for block in result.content]


async def effect_of(orders: "Orders", order_id: str) -> None:
    """Waits, without blocking the event loop, until the upstream has placed `order_id`."""
    with anyio.fail_after(20):
        while not orders.placed(order_id):
            await anyio.sleep(0.02)


async def call_while(session, arguments: dict, says: str):
    """Calls place_order until its answer no longer says `says`; that answer."""
    with anyio.fail_after(30):
        while True:
            answer = await session.call_tool("place_order", arguments)
            if says not in " ".join(texts(answer)):
                return answer
            await anyio.sleep(0.05)


async def test_a_double_call_reaches_the_upstream_once_and_replays_verbatim(orders):
    progress = []

    async def on_progress(done, total, message):
        progress.append((done, message))

    async with orders.session() as session:
        first = await session.call_tool("place_order", {"order_id": "o-1", "amount_cents": 500},
                                        progress_callback=on_progress)
        again = await session.call_tool("place_order", {"order_id": "o-1", "amount_cents": 500, "note": "retry"})
    assert not first.is_error, texts(first)
    # The upstream's progress, sent under the proxy's token, reaches the client under its own
    # (the TypeScript server reports none).
    assert progress == ([] if orders.command == TS_UPSTREAM else [(0.5, "charging")])
    assert texts(first) == ["order o-1 placed for 500 cents (#1)"]
    assert len(orders.placed("o-1")) == 1
    assert not again.is_error, texts(again)
    # The original content first, as the upstream sent it; then the marker.
    assert texts(again)[0] == texts(first)[0]
    marker = json.loads(texts(again)[-1])
    assert marker["replayed"] is True and marker["operation_id"]


async def test_a_model_reissue_with_a_new_key_or_a_new_session_is_the_same_operation(orders):
    async with orders.session() as session:
        first = await session.call_tool("place_order", {"order_id": "o-2", "amount_cents": 700},
                                        meta={"once/idempotency_key": "key-a"})
    # A new session, a fresh key: the intent (the order) names the operation.
    async with orders.session() as session:
        again = await session.call_tool("place_order", {"order_id": "o-2", "amount_cents": 700},
                                        meta={"once/idempotency_key": "key-b"})
    assert not first.is_error and not again.is_error
    assert texts(again)[0] == texts(first)[0]
    assert len(orders.placed("o-2")) == 1


async def test_unguarded_tools_and_lists_pass_through(orders):
    async with orders.session() as session:
        listed = await session.list_tools()
        await session.call_tool("place_order", {"order_id": "o-3", "amount_cents": 100})
        found = await session.call_tool("get_order", {"order_id": "o-3"})
        found_again = await session.call_tool("get_order", {"order_id": "o-3"})
    tools = {tool.name: tool for tool in listed.tools}
    assert "Guarded by once-ledger" in tools["place_order"].description
    assert tools["place_order"].description.startswith("Place an order")
    assert "once-ledger" not in (tools["get_order"].description or "")
    # A read-only tool is not guarded: each call reaches the upstream, and none is a replay.
    assert json.loads(texts(found)[0])["order_id"] == "o-3"
    assert len(texts(found_again)) == 1


async def test_concurrent_duplicate_calls_through_two_proxies_run_once(orders):
    async def call():
        async with orders.session() as session:
            return await session.call_tool("place_order", {"order_id": "o-4", "amount_cents": 900})

    results = await asyncio.gather(*(call() for _ in range(4)))
    assert len(orders.placed("o-4")) == 1
    performed = [r for r in results if not r.is_error]
    # Every call either has the one result (performed or replayed) or says it is in progress.
    for result in results:
        body = " ".join(texts(result))
        assert ("order o-4 placed" in body) or ("already in progress" in body), body
    assert performed


async def test_an_upstream_error_is_unknown_and_is_not_retried(orders):
    async with orders.session() as session:
        failed = await session.call_tool("place_order", {"order_id": "o-5", "amount_cents": -1})
        again = await session.call_tool("place_order", {"order_id": "o-5", "amount_cents": -1})
    assert failed.is_error
    body = " ".join(texts(failed))
    assert "being verified" in body and "Do not retry" in body, body
    # The upstream's own words follow the ledger's.
    assert "must be positive" in body, body
    assert again.is_error and "being verified" in " ".join(texts(again))


async def test_the_upstream_killed_mid_call_is_unknown_never_a_second_effect(orders):
    orders.hold.touch()
    async with orders.session() as session:
        call = asyncio.ensure_future(session.call_tool("place_order", {"order_id": "o-6", "amount_cents": 300}))
        await effect_of(orders, "o-6")
        pids = {o["pid"] for o in orders.placed("o-6")}
        for pid in pids:
            subprocess.run(["kill", "-9", str(pid)], check=True)
        with anyio.fail_after(30):
            result = await call
    assert result.is_error
    assert "being verified" in " ".join(texts(result)), texts(result)
    orders.hold.unlink()
    async with orders.session() as session:
        again = await session.call_tool("place_order", {"order_id": "o-6", "amount_cents": 300})
    assert again.is_error and "being verified" in " ".join(texts(again)), texts(again)
    assert len(orders.placed("o-6")) == 1


async def test_without_a_ledger_nothing_is_performed(orders):
    orders.stack.ledger.kill()
    async with orders.session() as session:
        result = await session.call_tool("place_order", {"order_id": "o-7", "amount_cents": 100})
        listed = await session.call_tool("get_order", {"order_id": "o-7"})
    assert result.is_error and "NOT performed" in " ".join(texts(result)), texts(result)
    assert orders.placed("o-7") == []
    assert texts(listed) == ["no such order"]
    # Said at start, and for the refused call: where, why, which tool and operation.
    log = (orders.tmp / "once-proxy.log").read_text()
    address = f"http://127.0.0.1:{orders.stack.ledger_port}"
    started = [line for line in log.splitlines() if "the ledger cannot be reached yet" in line]
    assert started and "ERROR" in started[0] and f"nothing listens at {address}" in started[0], log
    refused = [line for line in log.splitlines() if "a guarded call was not forwarded" in line]
    assert len(refused) == 1 and "WARN" in refused[0], log
    assert 'tool="place_order"' in refused[0] and "operation_id=order:" in refused[0], refused
    assert f"nothing listens at {address}" in refused[0], refused


async def test_the_proxys_metrics_are_closed_beyond_loopback_and_ask_for_their_token(tmp_path, backend):
    """Beyond loopback without a token, or with a weak one, the proxy does not start (exit 1,
    naming the flag); with a token, a scrape without it is answered 401 and one with it 200."""
    stack = make_stack(tmp_path, backend, "none", reconcile=False)
    try:
        orders = Orders(stack, tmp_path, "python")
        weak = write(tmp_path / "weak.token", "password\n")
        for flags, says in [
            (["--metrics-listen", "0.0.0.0:0"], "refusing to serve metrics on 0.0.0.0:0 without a token"),
            (["--metrics-listen", "127.0.0.1:0", "--metrics-token-file", str(weak)],
             f"--metrics-token-file {weak}"),
        ]:
            params = orders.params()
            ran = subprocess.run([params.command, *flags, *params.args], capture_output=True, text=True,
                                 timeout=60, stdin=subprocess.DEVNULL, env={**os.environ, **params.env})
            assert ran.returncode == 1 and says in ran.stderr, ran.stderr
            assert "password" not in ran.stderr.replace(str(weak), ""), "no token in a log"
        token = "4f1c0d9e6a534f0e9d7b2c1c3e0a9b41a8d3e6f70b5c4d2e91f0a7c3b8e2d6f5"
        orders.flags = ["--metrics-listen", "127.0.0.1:0",
                        "--metrics-token-file", str(write(tmp_path / "metrics.token", token + "\n"))]
        async with orders.session():
            log = tmp_path / "once-proxy.log"
            port = wait_for("the proxy's metrics", lambda: served_port(log, "serving Prometheus metrics", 0))
            url = f"http://127.0.0.1:{port}/metrics"
            try:
                urllib.request.urlopen(url, timeout=10)
                raise AssertionError("a scrape without the token was answered")
            except urllib.error.HTTPError as refused:
                assert refused.code == 401
            asked = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(asked, timeout=10) as response:
                assert response.status == 200
                assert "once_proxy_guarded_calls_total" in response.read().decode()
        assert token not in log.read_text(), "no token in a log"
    finally:
        stack.close()


def until_answered(proxy: subprocess.Popen) -> str:
    """What a starting proxy logged until it said the ledger answers it; the proxy is then
    stopped."""
    try:
        said = ""
        deadline = time.monotonic() + 30
        while "the ledger answers" not in said:
            assert time.monotonic() < deadline and proxy.poll() is None, said
            said += proxy.stderr.readline()
        return said
    finally:
        proxy.kill()
        proxy.wait()


async def test_the_proxys_metrics_count_guarded_calls_by_how_they_ended(tmp_path, backend):
    """--metrics-listen serves once_proxy_guarded_calls_total by tool and outcome: every series
    at 0 from the start, then one executed, one replayed, one conflict, and, with the ledger
    gone, one refused."""
    stack = make_stack(tmp_path, backend, "none", reconcile=False)
    try:
        orders = Orders(stack, tmp_path, "python")
        orders.flags = ["--metrics-listen", "127.0.0.1:0"]
        log = tmp_path / "once-proxy.log"

        def counted(text: str) -> dict[str, float]:
            found = {}
            for line in text.splitlines():
                if line.startswith("once_proxy_guarded_calls_total{") and 'tool="place_order"' in line:
                    outcome = re.search(r'outcome="([a-z_]+)"', line).group(1)
                    found[outcome] = float(line.rsplit(" ", 1)[1])
            return found

        async with orders.session() as session:
            port = wait_for("the proxy's metrics", lambda: served_port(log, "serving Prometheus metrics", 0))

            def scrape() -> dict[str, float]:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                    return counted(response.read().decode())

            assert set(scrape()) == {"executed", "not_performed", "ambiguous", "replayed", "in_progress",
                                     "unknown", "conflict", "refused"}
            assert sum(scrape().values()) == 0
            order = {"order_id": "o-m1", "amount_cents": 100}
            await session.call_tool("place_order", order)
            await session.call_tool("place_order", order)
            await session.call_tool("place_order", {**order, "amount_cents": 999})
            stack.ledger.kill()
            await session.call_tool("place_order", {"order_id": "o-m2", "amount_cents": 100})
            after = scrape()
        assert {k: v for k, v in after.items() if v} == \
            {"executed": 1, "replayed": 1, "conflict": 1, "refused": 1}, after
    finally:
        stack.close()


def started_proxy(stack, tmp: Path, ledger: str, key: str | None) -> subprocess.Popen:
    policy = write(tmp / "policy.toml", POLICY)
    env = {k: v for k, v in os.environ.items() if k != "ONCE_LEDGER_KEY"}
    if key is not None:
        env["ONCE_LEDGER_KEY"] = key
    return subprocess.Popen(
        [str(BIN / "once-proxy"), "--policy", str(policy), "--ledger", ledger, "--", *upstream_command("python")],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True,
    )


def test_the_proxy_checks_the_ledger_and_its_key_at_start(tenant_stack, tmp_path):
    """What no retry mends stops the proxy at start with an ERROR naming the ledger and the
    reason (a key the ledger refuses, a key without the executor role, TLS on one side only);
    a good key is named, with its tenant and the ledger's version."""
    stack = tenant_stack
    address = f"http://127.0.0.1:{stack.ledger_port}"
    reader = json.loads(stack.onced_command(
        "keys", "create", "--tenant", "acme", "--name", "acme-dashboard", "--role", "reader", "--json",
    ))["secret"]
    # Made in the database: the ledger, restarted, reads it.
    stack.ledger.stop()
    stack.start_ledger()
    https = f"https://127.0.0.1:{stack.ledger_port}"
    for ledger, key, says in [
        (address, "not-a-key-of-this-ledger-0123456789", "refuses the proxy's key"),
        (address, reader, "not the executor role"),
        (https, stack.keys["acme"], f"{https} speaks plaintext, not TLS: use {address}"),
    ]:
        proxy = started_proxy(stack, tmp_path, ledger, key)
        try:
            _, said = proxy.communicate(timeout=30)
        finally:
            proxy.kill()
        assert proxy.returncode == 1, said
        line = next(line for line in said.splitlines() if "once-proxy cannot use this ledger" in line)
        assert "ERROR" in line and says in line and ledger in line, said
        assert "not-a-key-of-this-ledger" not in said and reader not in said, "no key in a log"

    said = until_answered(started_proxy(stack, tmp_path, address, stack.keys["acme"]))
    line = next(line for line in said.splitlines() if "the ledger answers" in line)
    assert 'tenant="acme"' in line or "tenant=acme" in line, line
    assert "acme-refund-mcp" in line and "version=" in line, line


class RawSession:
    """A client writing raw JSON-RPC lines to an MCP server over stdio, for what an SDK would
    not send; every line the server writes back is kept, parsed, in `seen`."""

    def __init__(self, command: list[str], env: dict):
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, env={**os.environ, **env})
        self.ready = selectors.DefaultSelector()
        self.ready.register(self.process.stdout, selectors.EVENT_READ)
        # Read from the pipe unbuffered, into a buffer of the session's own: a buffered reader
        # could hold a second line while select() waits for more.
        self.pending = b""
        self.seen: list = []

    def __enter__(self) -> "RawSession":
        return self

    def __exit__(self, *_) -> None:
        self.process.kill()
        self.process.wait()

    def send(self, message) -> None:
        raw = message if isinstance(message, bytes) else json.dumps(message).encode()
        self.process.stdin.write(raw + b"\n")
        self.process.stdin.flush()

    def line(self) -> bytes:
        """The next line the server writes, byte for byte."""
        while b"\n" not in self.pending:
            assert self.ready.select(timeout=30), f"no answer after {self.seen}"
            chunk = os.read(self.process.stdout.fileno(), 65536)
            assert chunk, f"the server closed its output after {self.seen}"
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        self.seen.append(json.loads(line))
        return line + b"\n"

    def answer(self):
        self.line()
        return self.seen[-1]

    def answer_to(self, id) -> dict:
        while True:
            message = self.answer()
            if isinstance(message, dict) and message.get("id") == id:
                return message

    def initialize(self) -> None:
        self.send(SESSION[0])
        self.answer_to(1)
        self.send(SESSION[1])


def converse(command: list[str], env: dict, messages: list[dict], answers: int) -> list[bytes]:
    """Writes `messages` raw, the first (initialize) alone and the rest once it is answered, as a
    client does, and returns the first `answers` lines written back, byte for byte."""
    with RawSession(command, env) as session:
        session.send(messages[0])
        lines = [session.line()]
        for message in messages[1:]:
            session.send(message)
        return lines + [session.line() for _ in range(answers - 1)]


def place(id, order: str) -> dict:
    """A raw place_order request."""
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "place_order", "arguments": {"order_id": order, "amount_cents": 1}}}


SESSION = [
    {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "recorded", "version": "1"}}},
    {"jsonrpc": "2.0", "method": "notifications/initialized"},
    {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
    {"jsonrpc": "2.0", "id": "three", "method": "tools/call", "params": {"name": "get_order", "arguments": {"order_id": "none"}}},
    {"jsonrpc": "2.0", "id": 4, "method": "ping"},
    {"jsonrpc": "2.0", "id": 5, "method": "no/such/method"},
]


def test_answers_to_unguarded_messages_pass_byte_for_byte(orders):
    """A recorded session replayed straight to the upstream and through the proxy (a policy
    that does not annotate) gets the same answers, byte for byte (the upstream answers
    concurrent requests in any order)."""
    orders.policy.write_text(POLICY.replace("annotate = true", "annotate = false"))
    env = {"ORDERS_EFFECTS": str(orders.effects)}
    direct = converse(orders.command, env, SESSION, 5)
    params = orders.params()
    proxied = converse([params.command, *params.args], env, SESSION, 5)
    assert sorted(proxied) == sorted(direct)


def test_messages_that_could_reach_a_guarded_tool_past_the_ledger_are_refused(orders):
    """A batch carrying a guarded call (refused whole), keys that fold to the protocol's, bytes
    that cannot be parsed, and any request under the id of a guarded call in flight (`10`, and
    `10.0`, which the TypeScript SDK takes for 10): each is answered with an error and none
    reaches the upstream (the full corpus is in test_proxy_corpus.py)."""
    orders.hold.touch()
    with orders.raw() as session:
        session.initialize()
        session.send([place(7, "o-8"), {"jsonrpc": "2.0", "id": 8, "method": "ping"}])
        session.send({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                      "params": {"name": "get_order", "Name": "place_order", "arguments": {"order_id": "o-9"}}})
        session.send(place(10, "o-10"))
        # The held call o-10 is in flight; its id again, for any request, and a line that
        # cannot be parsed.
        wait_for("the held call's effect", lambda: orders.placed("o-10"))
        session.send(place(10, "o-11"))
        session.send({"jsonrpc": "2.0", "id": 10, "method": "ping"})
        session.send(b'{"jsonrpc": "2.0", "id": 10.0, "method": "tools/list"}')
        session.send(b'{"jsonrpc": "2.0", "id": 12, "method": "tools/call", "params": {"name": "place_order"')
        answers = [session.answer() for _ in range(6)]
        orders.hold.unlink()
        answers.append(session.answer())
    batch = next(a for a in answers if isinstance(a, list))
    assert [e["id"] for e in batch] == [7, 8] and all(e["error"]["code"] == -32600 for e in batch), batch
    unaddressed = [a for a in answers if isinstance(a, dict) and a.get("id") is None]
    unparsed = [a for a in unaddressed if a["error"]["code"] == -32700]
    # A request under an id in use is refused under no id: an answer under 10 would be taken by
    # the client for its call 10's.
    refused_reuse = [a for a in unaddressed if a["error"]["code"] == -32600]
    performed = [a for a in answers if isinstance(a, dict) and a.get("id") == 10]
    assert len(unparsed) == 2 and len(refused_reuse) == 3 and len(performed) == 1, answers
    assert all("in use" in a["error"]["message"] for a in refused_reuse), refused_reuse
    assert "o-10 placed" in performed[0]["result"]["content"][0]["text"], performed
    assert [o["order_id"] for o in orders.placed()] == ["o-10"]
    # The call travelled under the proxy's id, not the client's.
    assert str(orders.placed()[0]["request_id"]).startswith("once-proxy:"), orders.placed()


def test_a_call_past_its_timeout_is_unknown_and_its_late_answer_reaches_no_other_call(orders):
    """The upstream answers after the policy's timeout: the call was answered UNKNOWN, and the
    late answer (under the proxy's id) is dropped. The client's id is its own again: a ping and
    then a new guarded call under it get their own answers, never the late one."""
    orders.policy.write_text(POLICY.replace('timeout = "30s"', 'timeout = "500ms"'))
    orders.hold.touch()
    with orders.raw() as session:
        session.initialize()
        session.send(place(40, "o-40"))
        timed_out = json.dumps(session.answer_to(40))
        assert "being verified" in timed_out, timed_out
        # The upstream still holds o-40; an ordinary request under its id gets its own answer.
        session.send({"jsonrpc": "2.0", "id": 40, "method": "ping"})
        assert session.answer_to(40) == {"jsonrpc": "2.0", "id": 40, "result": {}}
        orders.hold.unlink()
        wait_for("the late answer", lambda: {"answering": "o-40"} in orders.lines())
        # A fresh order under the same id: performed, and answered with its own result.
        session.send(place(40, "o-41"))
        fresh = json.dumps(session.answer_to(40))
        session.send(place(41, "o-40"))
        again = json.dumps(session.answer_to(41))
        session.send({"jsonrpc": "2.0", "id": "last", "method": "ping"})
        session.answer_to("last")
    assert "o-41 placed" in fresh, fresh
    assert "being verified" in again, again
    assert not [m for m in session.seen if isinstance(m, dict) and "o-40 placed" in json.dumps(m)], session.seen
    assert sorted(o["order_id"] for o in orders.placed()) == ["o-40", "o-41"]


# Calls named by their `note` argument, an explicit key, with no intent.
KEYED_POLICY = POLICY.replace('intent = ["order", "{/order_id}"]\nvolatile = ["note"]', 'key = ["argument:note"]')


def test_a_fresh_key_argument_meets_the_fresh_id_guard(orders):
    """A policy naming calls by a key argument (`key = ["argument:note"]`, no intent): a model
    re-issuing a call in flight under a fresh key has a new operation id but the same
    fingerprint, since key arguments leave it, so the fresh-id guard holds it back."""
    orders.policy.write_text(KEYED_POLICY)
    orders.hold.touch()
    with orders.raw() as session:
        session.initialize()
        call = lambda id, note: {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "place_order", "arguments": {"order_id": "o-50", "amount_cents": 50, "note": note}}}
        session.send(call(50, "request-1"))
        wait_for("the held call's effect", lambda: orders.placed("o-50"))
        session.send(call(51, "request-2"))
        reissued = json.dumps(session.answer_to(51))
        orders.hold.unlink()
        first = json.dumps(session.answer_to(50))
    assert "already in progress" in reissued and "place_order:x:request-1" in reissued, reissued
    assert "o-50 placed" in first, first
    assert len(orders.placed("o-50")) == 1


AMOUNT_POLICY = POLICY.replace('intent = ["order", "{/order_id}"]',
                               'intent = ["order", "{/order_id}", "{/amount_cents}"]')


async def test_an_integer_the_intent_reads_sent_as_other_text_is_not_performed(orders):
    """The intent reads `amount_cents`, which every upstream lists as an integer. A model that
    sends 500 and then "0500" asks for one order: a lenient server would read both as 500, so
    the second spelling, another name for the same action, is never forwarded; "500" is the
    same name, and meets the first operation."""
    orders.policy.write_text(AMOUNT_POLICY)
    async with orders.session() as session:
        await session.list_tools()
        first = await session.call_tool("place_order", {"order_id": "o-int", "amount_cents": 500})
        respelled = await session.call_tool("place_order", {"order_id": "o-int", "amount_cents": "0500"})
        same = await session.call_tool("place_order", {"order_id": "o-int", "amount_cents": "500"})
    assert not first.is_error, texts(first)
    assert respelled.is_error and "declares it an integer" in " ".join(texts(respelled)), texts(respelled)
    assert "NOT performed" in " ".join(texts(respelled)), texts(respelled)
    # The integer's own digits name what the number names; the arguments differ in their type,
    # so the ledger says so (CONFLICT) rather than running it.
    assert "already requested with different arguments" in " ".join(texts(same)), texts(same)
    assert len(orders.placed("o-int")) == 1


def test_absent_for_a_tool_with_an_output_schema_is_refused_at_load(orders):
    """`on_error = "absent"` on a tool that declares an outputSchema: its SDK validates the
    output after the tool ran, so an error may follow the effect. The proxy lists the upstream's
    tools at start and refuses to run; the linter warns."""
    orders.policy.write_text(POLICY + '\n[tools.place_typed_order]\non_error = "absent"\n')
    params = orders.params()
    done = subprocess.run([params.command, *params.args], input=b"", capture_output=True, timeout=60,
                          env={**os.environ, **params.env})
    assert done.returncode != 0, done
    assert b"tools.place_typed_order: on_error" in done.stderr and b"outputSchema" in done.stderr, done.stderr
    assert orders.placed() == []
    linted = subprocess.run([str(BIN / "once-proxy"), "check", str(orders.policy), "--against", "--", *orders.command],
                            capture_output=True, text=True, timeout=60, env={**os.environ, **params.env})
    assert linted.returncode == 1, linted
    assert "declares an outputSchema" in next(l for l in linted.stdout.splitlines() if l.startswith("place_typed_order")), linted.stdout
    # Without the claim, the typed tool's output-validation error is UNKNOWN, not ABSENT.
    orders.policy.write_text(POLICY + '\n[tools.place_typed_order]\n')
    with orders.raw() as session:
        session.initialize()
        session.send({"jsonrpc": "2.0", "id": 60, "method": "tools/call",
                      "params": {"name": "place_typed_order", "arguments": {"order_id": "o-60", "amount_cents": 13}}})
        answer = json.dumps(session.answer_to(60))
    assert len(orders.placed("o-60")) == 1
    # FastMCP does not validate output; the other two do, after the effect.
    assert ("being verified" in answer) != (orders.command == upstream_command("fastmcp")), answer


def test_the_upstream_inherits_neither_the_ledger_key_nor_what_env_remove_names(orders, tmp_path):
    dumped = tmp_path / "upstream-env.json"
    script = tmp_path / "env_then_serve.py"
    script.write_text(
        "import json, os, sys\n"
        f"open({str(dumped)!r}, 'w').write(json.dumps(dict(os.environ)))\n"
        "os.execv(sys.argv[1], sys.argv[1:])\n")
    params = orders.params()
    proxy = [params.command, "--env-remove", "ORDERS_SECRET", *params.args]
    dash = proxy.index("--", proxy.index("--ledger"))
    proxy[dash + 1:dash + 1] = [sys.executable, str(script)]
    env = {**params.env, "ONCE_LEDGER_KEY": "once_leaked_key_material_0123456789", "ORDERS_SECRET": "s3cret",
           "ORDERS_PLAIN": "kept"}
    with RawSession(proxy, env) as session:
        session.initialize()
        session.send({"jsonrpc": "2.0", "id": "ok", "method": "ping"})
        session.answer_to("ok")
    inherited = json.loads(dumped.read_text())
    assert "ONCE_LEDGER_KEY" not in inherited and "ORDERS_SECRET" not in inherited, sorted(inherited)
    assert inherited["ORDERS_PLAIN"] == "kept" and inherited["ORDERS_EFFECTS"] == str(orders.effects)


def test_a_cancelled_call_is_relayed_unknown_and_never_answered(orders):
    """The client cancels a guarded call after the upstream performed it: the cancellation
    reaches the upstream, the proxy answers nothing for it, and the ledger holds it UNKNOWN."""
    orders.hold.touch()
    with orders.raw() as session:
        session.initialize()
        session.send(place(20, "o-20"))
        wait_for("the held call's effect", lambda: orders.placed("o-20"))
        session.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 20, "reason": "user"}})
        wait_for("the cancellation to reach the upstream", orders.cancelled)
        # The same order again: in progress until the cancelled attempt's report lands, then
        # UNKNOWN, never performed a second time.
        asked = iter(range(100, 10_000))
        texts_seen: list[str] = []

        def verified() -> bool:
            n = next(asked)
            session.send(place(n, "o-20"))
            texts_seen.append(json.dumps(session.answer_to(n)))
            return "being verified" in texts_seen[-1]

        wait_for("the cancelled call to be UNKNOWN", verified)
        assert all("being verified" in t or "already in progress" in t for t in texts_seen), texts_seen
        orders.hold.unlink()
        session.send({"jsonrpc": "2.0", "id": "last", "method": "ping"})
        session.answer_to("last")
    assert not [m for m in session.seen if isinstance(m, dict) and m.get("id") == 20], session.seen
    assert orders.cancelled() == ["o-20"]
    assert len(orders.placed("o-20")) == 1


async def test_a_call_longer_than_its_lease_is_kept_alive_by_heartbeats(orders):
    """The policy's lease is 2 s. A call held past it stays IN_FLIGHT, its lease extended
    beyond where it began by more than two leases, and then confirms."""
    def in_flight() -> list[dict]:
        done = subprocess.run(
            [str(BIN / "oncectl"), "list", "--state", "IN_FLIGHT", "--json",
             "--addr", f"http://127.0.0.1:{orders.stack.ledger_port}"],
            capture_output=True, text=True, check=True)
        return json.loads(done.stdout)["operations"]

    def extended() -> bool:
        for op in in_flight():
            began = datetime.fromisoformat(op["created_at"])
            if datetime.fromisoformat(op["lease_deadline"]) - began > timedelta(seconds=4):
                return True
        return False

    orders.hold.touch()
    async with orders.session() as session:
        call = asyncio.ensure_future(session.call_tool("place_order", {"order_id": "o-30", "amount_cents": 1}))
        with anyio.fail_after(30):
            while not await anyio.to_thread.run_sync(extended):
                await anyio.sleep(0.1)
        orders.hold.unlink()
        with anyio.fail_after(30):
            result = await call
    assert not result.is_error, texts(result)
    assert texts(result) == ["order o-30 placed for 1 cents (#1)"]


def checked(tmp_path: Path, policy: str, *against: str) -> tuple[int, dict[str, str]]:
    """`once-proxy check` of `policy` with `against`'s flags: its exit code, and its lines by
    the tool each starts with (a tool's lines joined)."""
    path = tmp_path / "policy.toml"
    path.write_text(policy)
    done = subprocess.run(
        [str(BIN / "once-proxy"), "check", str(path), *against],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "ORDERS_EFFECTS": str(tmp_path / "effects.jsonl")})
    lines: dict[str, str] = {}
    for line in done.stdout.splitlines()[1:]:
        if line.strip() and not line.startswith(" "):
            tool = line.split()[0]
            lines[tool] = lines.get(tool, "") + line + "\n"
    return done.returncode, lines


def test_the_linter_lists_the_upstreams_tools_and_warns_about_unguarded_ones(tmp_path):
    def check(policy: str) -> tuple[int, dict[str, str]]:
        return checked(tmp_path, policy, "--against", "--", sys.executable, str(UPSTREAM))

    code, lines = check(POLICY + "\n[tools.place_typed_order]\n")
    assert code == 0, lines
    assert "guarded, intent order" in lines["place_order"]
    assert "passes through (readOnlyHint)" in lines["get_order"]

    code, lines = check("[tools.refund_order]\n")
    assert code == 1, lines
    assert "WARNING: may change state" in lines["place_order"]
    assert "lists no such tool" in lines["refund_order"]
    assert "WARNING" not in lines["get_order"]


TYPO_POLICY = """
[tools.place_order]
intent = ["order", "{/order_d}"]
volatile = ["nte"]
lookup_hints = { order_id = "{/order_id}" }
on_error = "absent"

[tools.place_typed_order]
intent = ["order", "{/order_id}"]
"""


def test_the_linter_compares_what_a_policy_reads_with_each_tools_input_schema(tmp_path):
    """A typo in a pointer or a volatile name is a warning naming the setting and the members
    the tool has (exit 1); a guarded tool left at the default on_error gets a note saying what
    that costs, which alone does not fail the check; the policy alone only parses."""
    code, lines = checked(tmp_path, TYPO_POLICY, "--against", "--", sys.executable, str(UPSTREAM))
    assert code == 1, lines
    place = lines["place_order"]
    assert 'WARNING: intent reads {/order_d}, but the inputSchema has no "order_d"' in place, place
    assert "order_id" in place and "every call would be refused" in place, place
    assert 'WARNING: volatile reads nte, but the inputSchema has no "nte"' in place, place
    assert "lookup_hints" not in place, place
    assert "note:" not in place, "on_error = absent: no note"
    typed = lines["place_typed_order"]
    assert "WARNING" not in typed and 'note: on_error = "unknown" (the default)' in typed, typed

    fixed = TYPO_POLICY.replace("order_d", "order_id").replace('"nte"', '"note"') \
        .replace('on_error = "absent"\n', "")
    code, lines = checked(tmp_path, fixed, "--against", "--", sys.executable, str(UPSTREAM))
    assert code == 0, lines
    assert "WARNING" not in "".join(lines.values()), lines

    code, lines = checked(tmp_path, TYPO_POLICY)
    assert code == 0, lines
    assert "guarded, intent order" in lines["place_order"], lines


# Streamable HTTP: the proxy as an MCP endpoint in front of the upstream's.

HTTP_SERVING = "once-proxy serving MCP over Streamable HTTP"

RECONCILED_POLICY = POLICY.replace('volatile = ["note"]', '''volatile = ["note"]
provider = "orders"
lookup_hints = { order_id = "{/order_id}" }
provider_key = "argument:idempotency_key"''')


class HttpOrders(Orders):
    """The upstream served over Streamable HTTP on its own port, the proxy in front of it, and a
    ledger whose `http` reconciler reads the upstream's lookup route."""

    def __init__(self, tmp: Path, backend: str, language: str = "python", policy: str = RECONCILED_POLICY,
                 gateway: bool = False, upstream_first: bool = True, proxy_args: tuple = (),
                 settle_time: str = "100ms"):
        """`gateway`: a gateway between the proxy and the upstream that refuses tool calls
        with 403 after the upstream answered them. `upstream_first`: the upstream is started
        before the proxy (otherwise call `start_upstream`). `settle_time`: how long after an
        attempt the reconciler may first look it up."""
        self.language = language
        self.upstream_port = free_port()
        config = (
            "[reconciliation]\ninterval = \"100ms\"\nfirst_backoff = \"100ms\"\nmax_backoff = \"500ms\"\n\n"
            "[[reconciler]]\nname = \"orders\"\nkind = \"http\"\n"
            f"endpoint = \"http://127.0.0.1:{self.upstream_port}\"\n"
            "url = \"{endpoint}/orders/{hints.order_id}?key={provider_key}\"\n"
            "found_status = [200]\nnot_found_status = [404]\nprovider_ref_pointer = \"/id\"\n"
            f"miss_is_authoritative = true\nsettle_time = \"{settle_time}\"\n"
        )
        super().__init__(make_stack(tmp, backend, "none", reconcile=False, config=config), tmp, language)
        self.policy.write_text(policy)
        self.upstream = None
        self.received = tmp / "received.jsonl"
        target = self.upstream_port
        if gateway:
            target = free_port()
            self.stack.spawn_logged(
                [sys.executable, str(UPSTREAMS / "recorder.py"), "http", str(self.received), str(target),
                 f"http://127.0.0.1:{self.upstream_port}/mcp", "--forbid-tool-calls"], tmp / "gateway.log")
            wait_for("the gateway", lambda: socket.create_connection(("127.0.0.1", target), timeout=1).close() or True)
        if upstream_first:
            self.start_upstream()
        self.log = tmp / "once-proxy-http.log"
        self.proxy = self.stack.spawn_logged(
            [str(BIN / "once-proxy"), "--policy", str(self.policy),
             "--ledger", f"http://127.0.0.1:{self.stack.ledger_port}",
             "--listen", "127.0.0.1:0", "--upstream", f"http://127.0.0.1:{target}/mcp", *proxy_args],
            self.log,
        )
        self.proxy_port = wait_for("once-proxy", lambda: served_port(self.log, HTTP_SERVING, 0))

    def __enter__(self) -> "HttpOrders":
        return self

    def __exit__(self, *_) -> None:
        self.stack.close()

    def start_upstream(self) -> None:
        env = {**os.environ, "ORDERS_EFFECTS": str(self.effects), "ORDERS_HOLD": str(self.hold)}
        self.upstream = self.stack.spawn_logged(
            [*self.command, "--http", str(self.upstream_port)], self.tmp / "orders-http.log", env=env)
        wait_for("the upstream", lambda: socket.create_connection(("127.0.0.1", self.upstream_port), timeout=1).close() or True)

    @contextlib.asynccontextmanager
    async def session(self):
        async with streamable_http_client(f"http://127.0.0.1:{self.proxy_port}/mcp") as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session

    def post(self, message: dict, session: str | None = None):
        """POSTs one raw message to the proxy; the open response (read it, or close it to drop the
        stream)."""
        headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
                   "mcp-protocol-version": "2025-11-25"}
        if session:
            headers["mcp-session-id"] = session
        request = urllib.request.Request(f"http://127.0.0.1:{self.proxy_port}/mcp", method="POST",
                                         data=json.dumps(message).encode(), headers=headers)
        return urllib.request.urlopen(request, timeout=30)


@pytest.fixture
def http_orders(tmp_path, backend):
    with HttpOrders(tmp_path, backend) as orders:
        yield orders


@pytest.fixture
def http_ts_orders(tmp_path, backend):
    """The TypeScript upstream over Streamable HTTP (stateless), the proxy in front of it."""
    with HttpOrders(tmp_path, backend, "typescript") as orders:
        yield orders


async def test_http_in_front_of_the_typescript_server_a_double_call_runs_once(http_ts_orders):
    async with http_ts_orders.session() as session:
        first = await session.call_tool("place_order", {"order_id": "t-1", "amount_cents": 500})
    async with http_ts_orders.session() as session:
        again = await session.call_tool("place_order", {"order_id": "t-1", "amount_cents": 500})
        found = await session.call_tool("get_order", {"order_id": "t-1"})
        failed = await session.call_tool("place_order", {"order_id": "t-2", "amount_cents": -1})
    assert not first.is_error, texts(first)
    assert texts(first) == ["order t-1 placed for 500 cents (#1)"]
    assert texts(again)[0] == texts(first)[0] and json.loads(texts(again)[-1])["replayed"] is True
    assert json.loads(texts(found)[0])["order_id"] == "t-1"
    assert failed.is_error and "being verified" in " ".join(texts(failed)), texts(failed)
    assert len(http_ts_orders.placed("t-1")) == 1


def test_the_linter_reads_a_streamable_http_servers_tools(http_orders):
    code, lines = checked(http_orders.tmp, TYPO_POLICY, "--against-url",
                          f"http://127.0.0.1:{http_orders.upstream_port}/mcp")
    assert code == 1, lines
    assert 'WARNING: intent reads {/order_d}' in lines["place_order"], lines
    assert "passes through (readOnlyHint)" in lines["get_order"], lines


async def test_http_a_double_call_reaches_the_upstream_once_with_progress_relayed(http_orders):
    progress = []

    async def on_progress(done, total, message):
        progress.append((done, message))

    async with http_orders.session() as session:
        listed = await session.list_tools()
        first = await session.call_tool("place_order", {"order_id": "h-1", "amount_cents": 500},
                                        progress_callback=on_progress)
    async with http_orders.session() as session:
        again = await session.call_tool("place_order", {"order_id": "h-1", "amount_cents": 500})
        found = await session.call_tool("get_order", {"order_id": "h-1"})
    assert not first.is_error, texts(first)
    assert texts(first) == ["order h-1 placed for 500 cents (#1)"]
    assert progress == [(0.5, "charging")]
    assert texts(again)[0] == texts(first)[0] and json.loads(texts(again)[-1])["replayed"] is True
    assert json.loads(texts(found)[0])["order_id"] == "h-1"
    assert "Guarded by once-ledger" in {t.name: t for t in listed.tools}["place_order"].description
    assert len(http_orders.placed("h-1")) == 1


def initialized(http_orders) -> str:
    with http_orders.post({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}) as answer:
        session = answer.headers["mcp-session-id"]
        answer.read()
    http_orders.post({"jsonrpc": "2.0", "method": "notifications/initialized"}, session).close()
    return session


async def test_http_a_retry_after_a_dropped_stream_runs_once(http_orders):
    session = initialized(http_orders)
    http_orders.hold.touch()
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "place_order", "arguments": {"order_id": "h-2", "amount_cents": 200}, "_meta": {"progressToken": 9}}}
    streamed = await anyio.to_thread.run_sync(http_orders.post, call, session)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    # The progress event arrives while the call is held; then the client's stream drops.
    while b"notifications/progress" not in await anyio.to_thread.run_sync(streamed.readline):
        pass
    streamed.close()
    assert len(http_orders.placed("h-2")) == 1
    http_orders.hold.unlink()

    async with http_orders.session() as mcp_session:
        again = await call_while(mcp_session, {"order_id": "h-2", "amount_cents": 200}, "already in progress")
    assert not again.is_error, texts(again)
    assert texts(again)[0] == "order h-2 placed for 200 cents (#1)"
    assert json.loads(texts(again)[-1])["replayed"] is True
    assert len(http_orders.placed("h-2")) == 1


async def test_http_the_upstream_killed_mid_call_is_unknown_then_reconciled(http_orders):
    http_orders.hold.touch()
    async with http_orders.session() as session:
        call = asyncio.ensure_future(session.call_tool("place_order", {"order_id": "h-3", "amount_cents": 300}))
        await effect_of(http_orders, "h-3")
        http_orders.upstream.kill()
        with anyio.fail_after(30):
            result = await call
    assert result.is_error and "being verified" in " ".join(texts(result)), texts(result)
    http_orders.hold.unlink()
    # The upstream back; the ledger's reconciler finds the order at its lookup route.
    http_orders.start_upstream()
    async with http_orders.session() as session:
        again = await call_while(session, {"order_id": "h-3", "amount_cents": 300}, "being verified")
    assert not again.is_error, texts(again)
    # Replayed from the provider's record, as the reconciler stored it.
    assert json.loads(texts(again)[0])["id"] == "ord_h-3"
    assert json.loads(texts(again)[-1])["replayed"] is True
    assert len(http_orders.placed("h-3")) == 1


async def test_http_the_stateless_2026_07_28_revision_is_guarded_too(http_orders):
    """The 2026-07-28 revision: no initialize, no session; each request a POST of its own."""
    url = f"http://127.0.0.1:{http_orders.proxy_port}/mcp"
    async with Client(url, mode="2026-07-28") as client:
        listed = await client.list_tools()
        first = await client.call_tool("place_order", {"order_id": "h-4", "amount_cents": 400})
    async with Client(url, mode="2026-07-28") as client:
        again = await client.call_tool("place_order", {"order_id": "h-4", "amount_cents": 400})
    # The handshake era sees the same operation.
    async with http_orders.session() as session:
        legacy = await session.call_tool("place_order", {"order_id": "h-4", "amount_cents": 400})
    assert not first.is_error, texts(first)
    assert "Guarded by once-ledger" in {t.name: t for t in listed.tools}["place_order"].description
    for replayed in (again, legacy):
        assert texts(replayed)[0] == texts(first)[0]
        assert json.loads(texts(replayed)[-1])["replayed"] is True
    assert len(http_orders.placed("h-4")) == 1


def answer_of(response) -> dict:
    """The JSON-RPC answer in a proxy's HTTP response (one JSON body, or the last message of an
    event stream that answers a request)."""
    data = response.read().decode()
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        messages = [json.loads(line[5:]) for line in data.splitlines() if line.startswith("data:")]
        return [m for m in messages if "method" not in m][-1]
    return json.loads(data)


def http_call(order: str, id=2, tool: str = "place_order", amount: int = 200, **arguments) -> dict:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": tool, "arguments": {"order_id": order, "amount_cents": amount, **arguments}}}


async def test_http_an_id_in_use_in_a_session_is_refused_for_any_request(http_orders):
    """A guarded call held in flight in a session: any request under its id in that session (a
    ping, `2.0`) is refused, as a stateful server would route its answer to the latest stream
    with that id; another session may use the id."""
    session = initialized(http_orders)
    http_orders.hold.touch()
    held = http_call("h-5")
    held["params"]["_meta"] = {"progressToken": 5}  # the proxy's answer streams from the first event
    streamed = await anyio.to_thread.run_sync(http_orders.post, held, session)
    await effect_of(http_orders, "h-5")
    for reused in ({"jsonrpc": "2.0", "id": 2, "method": "ping"}, {"jsonrpc": "2.0", "id": 2.0, "method": "ping"},
                   http_call("h-6")):
        with http_orders.post(reused, session) as refused:
            answer = answer_of(refused)
        assert "in use" in answer["error"]["message"], answer
    with http_orders.post({"jsonrpc": "2.0", "id": 2, "method": "ping"}, initialized(http_orders)) as other:
        assert answer_of(other) == {"jsonrpc": "2.0", "id": 2, "result": {}}
    http_orders.hold.unlink()
    answer = await anyio.to_thread.run_sync(answer_of, streamed)
    assert answer["id"] == 2 and "h-5 placed" in answer["result"]["content"][0]["text"], answer
    assert [o["order_id"] for o in http_orders.placed()] == ["h-5"]
    assert str(http_orders.placed()[0]["request_id"]).startswith("once-proxy:")


@pytest.fixture(params=["unknown", "absent"])
def gated_orders(tmp_path, backend, request):
    """Behind a gateway that refuses tool calls after the upstream ran them; the policy's
    on_error either way (it speaks of the tool's errors, not the gateway's). The reconciler
    waits out the test before it looks: what the calls see is the proxy's judgement alone."""
    policy = RECONCILED_POLICY.replace('timeout = "30s"', f'timeout = "30s"\non_error = "{request.param}"')
    with HttpOrders(tmp_path, backend, policy=policy, gateway=True, settle_time="5m") as orders:
        yield orders


async def test_http_a_403_after_the_effect_is_unknown_not_absent(gated_orders):
    """A gateway between proxy and server answers 403 after the tool ran: not one of an SDK's
    pre-dispatch refusals, so the effect may have happened; UNKNOWN, and never a second run."""
    async with gated_orders.session() as session:
        first = await session.call_tool("place_order", {"order_id": "g-1", "amount_cents": 100})
        again = await session.call_tool("place_order", {"order_id": "g-1", "amount_cents": 100})
    for result in (first, again):
        assert result.is_error and "being verified" in " ".join(texts(result)), texts(result)
    assert len(gated_orders.placed("g-1")) == 1


@pytest.fixture(params=["stdio", "http"])
def keyed_orders(tmp_path, backend, request):
    """once-proxy with a policy that names place_order's calls by their `note` argument."""
    if request.param == "http":
        orders = HttpOrders(tmp_path, backend, policy=KEYED_POLICY)
    else:
        orders = Orders(make_stack(tmp_path, backend, "none", reconcile=False), tmp_path)
        orders.policy.write_text(KEYED_POLICY)
    try:
        yield orders
    finally:
        orders.stack.close()


async def test_a_fresh_key_argument_meets_the_fresh_id_guard_on_both_transports(keyed_orders):
    keyed_orders.hold.touch()
    arguments = {"order_id": "k-1", "amount_cents": 70}
    async with keyed_orders.session() as session:
        held = asyncio.ensure_future(session.call_tool("place_order", {**arguments, "note": "request-1"}))
        await effect_of(keyed_orders, "k-1")
        reissued = await session.call_tool("place_order", {**arguments, "note": "request-2"})
        keyed_orders.hold.unlink()
        with anyio.fail_after(30):
            first = await held
    assert reissued.is_error and "already in progress" in " ".join(texts(reissued)), texts(reissued)
    assert "place_order:x:request-1" in " ".join(texts(reissued))
    assert not first.is_error, texts(first)
    assert len(keyed_orders.placed("k-1")) == 1


TYPED_ABSENT = POLICY + '\n[tools.place_typed_order]\non_error = "absent"\n'


def test_http_absent_for_a_tool_with_an_output_schema_is_refused_at_start(http_orders):
    done = subprocess.run(
        [str(BIN / "once-proxy"), "--policy", str(write(http_orders.tmp / "typed.toml", TYPED_ABSENT)),
         "--ledger", f"http://127.0.0.1:{http_orders.stack.ledger_port}", "--listen", "127.0.0.1:0",
         "--upstream", f"http://127.0.0.1:{http_orders.upstream_port}/mcp"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "tools.place_typed_order: on_error" in done.stderr, done.stderr


@pytest.fixture
def late_typed_orders(tmp_path, backend):
    """The typed-absent policy, the proxy started before the upstream could be listed; the
    reconciler waits out the test, so the calls see the proxy's judgement alone."""
    with HttpOrders(tmp_path, backend, policy=TYPED_ABSENT, upstream_first=False, settle_time="5m") as orders:
        yield orders


async def test_http_absent_is_not_applied_once_a_listing_shows_an_output_schema(late_typed_orders):
    """The upstream could not be listed at start; a client's listing then shows the typed tool's
    outputSchema, and its output-validation error (after the effect) is UNKNOWN, not ABSENT."""
    late_typed_orders.start_upstream()
    async with late_typed_orders.session() as session:
        listed = await session.list_tools()
        failed = await session.call_tool("place_typed_order", {"order_id": "t-13", "amount_cents": 13})
        again = await session.call_tool("place_typed_order", {"order_id": "t-13", "amount_cents": 13})
    assert "place_typed_order" in {t.name for t in listed.tools}
    for result in (failed, again):
        assert result.is_error and "being verified" in " ".join(texts(result)), texts(result)
    assert len(late_typed_orders.placed("t-13")) == 1
    assert "tools.place_typed_order: on_error" in late_typed_orders.log.read_text()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def recording(tmp: Path, stack, upstream: str) -> tuple[int, Path]:
    """A recorder in front of `upstream` (what reaches it, in the file); its port, once it
    listens, and the file."""
    port, received = free_port(), tmp / "seen-by-upstream.jsonl"
    stack.spawn_logged([sys.executable, str(UPSTREAMS / "recorder.py"), "http", str(received), str(port), upstream],
                       tmp / "recorder.log")
    wait_for("the recorder", lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() or True)
    return port, received


def serve_proxy(tmp: Path, stack, *args: str, name: str = "proxy") -> tuple[int, Path]:
    """Starts once-proxy over HTTP with `args`; its port and log."""
    log = tmp / f"{name}.log"
    stack.spawn_logged([str(BIN / "once-proxy"), "--policy", str(write(tmp / f"{name}.toml", POLICY)),
                        "--ledger", f"http://127.0.0.1:{stack.ledger_port}", *args], log)
    return wait_for(name, lambda: served_port(log, HTTP_SERVING, 0)), log


def request(url: str, message: dict | bytes, headers: dict | None = None, context=None) -> tuple[int, bytes]:
    body = message if isinstance(message, bytes) else json.dumps(message).encode()
    sent = urllib.request.Request(url, method="POST", data=body, headers={
        "accept": "application/json, text/event-stream", "content-type": "application/json",
        "mcp-protocol-version": "2025-11-25", **(headers or {})})
    try:
        with urllib.request.urlopen(sent, timeout=30, context=context) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def certificate(tmp: Path, name: str, issuer: tuple | None = None) -> tuple[Path, Path, tuple]:
    """A certificate for localhost and 127.0.0.1 (a CA's, self-signed, when `issuer` is None;
    else a leaf it signs), its key, and what signs with it."""
    import ipaddress
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = (subject, key) if issuer is None else issuer
    now = datetime.now() - timedelta(minutes=5)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True))
    builder = builder.add_extension(x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    if issuer is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    cert_path, key_path = tmp / f"{name}.crt", tmp / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path, (subject, key)


def test_the_proxy_presents_a_client_certificate_to_a_ledger_that_asks_for_one(tmp_path):
    tmp = tmp_path
    # A server certificate signed by a CA: rustls refuses a CA's own certificate as a server's.
    ledger_ca, _, ledger_signer = certificate(tmp, "ledger-ca")
    server_cert, server_key, _ = certificate(tmp, "ledger", issuer=ledger_signer)
    client_ca, _, signer = certificate(tmp, "clients")
    leaf, leaf_key, _ = certificate(tmp, "proxy", issuer=signer)
    log = tmp / "onced.log"
    ledger = Process([str(BIN / "onced"), "--database-url", f"sqlite://{tmp / 'ledger.db'}",
                      "--listen", "127.0.0.1:0", "--tls-cert", str(server_cert), "--tls-key", str(server_key),
                      "--tls-client-ca", str(client_ca)], log)
    try:
        port = wait_for("onced", lambda: served_port(log, "onced serving", 0))
        address = f"https://localhost:{port}"
        policy = write(tmp / "policy.toml", POLICY)

        def proxy(*flags: str) -> subprocess.Popen:
            return subprocess.Popen(
                [str(BIN / "once-proxy"), "--policy", str(policy), "--ledger", address,
                 "--ledger-ca", str(ledger_ca), *flags, "--", *upstream_command("python")],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

        anonymous = proxy()
        _, said = anonymous.communicate(timeout=30)
        assert anonymous.returncode == 1, said
        assert f"{address} asks for a client certificate" in said and "--ledger-cert" in said, said

        until_answered(proxy("--ledger-cert", str(leaf), "--ledger-cert-key", str(leaf_key)))
    finally:
        ledger.stop()


def test_http_a_listener_beyond_loopback_needs_tls_and_a_client_credential(http_orders):
    """Refused at start without TLS, or with TLS and no client credential, unless --insecure;
    served with both, where a request without the token is refused (401) before anything is
    forwarded, and the token never reaches the upstream."""
    tmp, stack = http_orders.tmp, http_orders.stack
    upstream = f"http://127.0.0.1:{http_orders.upstream_port}/mcp"
    cert, key, _ = certificate(tmp, "proxy")
    token = write(tmp / "client.token", "a-client-token-of-some-length\n")
    base = [str(BIN / "once-proxy"), "--policy", str(write(tmp / "p.toml", POLICY)),
            "--ledger", f"http://127.0.0.1:{stack.ledger_port}", "--upstream", upstream, "--listen", "0.0.0.0:0"]
    for extra, missing in (([], "without TLS"), (["--tls-cert", str(cert), "--tls-key", str(key)], "without a client credential")):
        done = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "beyond loopback" in done.stderr and missing in done.stderr, done.stderr
    insecure, _ = serve_proxy(tmp, stack, "--listen", "0.0.0.0:0", "--upstream", upstream, "--insecure", name="insecure")
    assert request(f"http://127.0.0.1:{insecure}/mcp", SESSION[0])[0] == 200

    recorder_port, received = recording(tmp, stack, upstream)
    port, _ = serve_proxy(tmp, stack, "--listen", "0.0.0.0:0", "--upstream", f"http://127.0.0.1:{recorder_port}/mcp",
                          "--tls-cert", str(cert), "--tls-key", str(key), "--client-token-file", str(token), name="tls")
    import ssl
    trusted = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}/mcp"
    initialize = SESSION[0]
    assert request(url, initialize, context=trusted)[0] == 401
    assert request(url, initialize, {"authorization": "Bearer not-the-token-at-all"}, context=trusted)[0] == 401
    assert not received.exists() or received.read_text() == ""
    status, body = request(url, initialize, {"authorization": "Bearer a-client-token-of-some-length"}, context=trusted)
    assert status == 200, body
    (seen,) = [json.loads(line) for line in received.read_text().splitlines()]
    assert "authorization" not in seen["headers"], seen
    assert seen["headers"]["x-forwarded-host"] == f"127.0.0.1:{port}" and seen["headers"]["x-forwarded-proto"] == "https"

    # Client certificates are the other credential: a client without one does not get through
    # the handshake.
    ca, _, signer = certificate(tmp, "clients-ca")
    client_cert, client_key, _ = certificate(tmp, "client", issuer=signer)
    mutual, _ = serve_proxy(tmp, stack, "--listen", "0.0.0.0:0", "--upstream", upstream, "--tls-cert", str(cert),
                            "--tls-key", str(key), "--tls-client-ca", str(ca), name="mtls")
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        request(f"https://127.0.0.1:{mutual}/mcp", initialize, context=trusted)
    presenting = ssl.create_default_context(cafile=str(cert))
    presenting.load_cert_chain(str(client_cert), str(client_key))
    assert request(f"https://127.0.0.1:{mutual}/mcp", initialize, context=presenting)[0] == 200


def test_http_origin_host_and_size_are_refused_before_the_ledger_is_asked(http_orders):
    """A page of another origin, a rebound host name, a body past --max-body: refused (403,
    421, 413) with the ledger down and nothing reaching the upstream."""
    tmp, stack = http_orders.tmp, http_orders.stack
    recorder_port, received = recording(tmp, stack, f"http://127.0.0.1:{http_orders.upstream_port}/mcp")
    port, _ = serve_proxy(tmp, stack, "--listen", "127.0.0.1:0", "--upstream", f"http://127.0.0.1:{recorder_port}/mcp",
                          "--max-body", "1K", "--allowed-origin", "http://app.example", name="door")
    stack.ledger.kill()
    url = f"http://127.0.0.1:{port}/mcp"
    call = http_call("d-1")
    assert request(url, call, {"origin": "http://evil.example"})[0] == 403
    assert request(url, call, {"origin": "null"})[0] == 403
    assert request(url, call, {"host": f"evil.example:{port}"})[0] == 421
    assert request(url, call, {"host": "localhost:1"})[0] == 421
    assert request(url, http_call("d-1", note="x" * 2048))[0] == 413
    assert request(url, call, {"mcp-session-id": "s\xff"})[0] == 400
    assert not received.exists() or received.read_text() == ""
    # The loopback names and an allowed origin are let in (the ledger is down: not performed).
    for headers in ({"origin": f"http://localhost:{port}"}, {"origin": "http://app.example"}, {"host": f"localhost:{port}"}):
        status, body = request(url, call, headers)
        assert status == 200 and b"NOT performed" in body, (headers, body)
    assert http_orders.placed() == []


def test_http_the_upstreams_credentials_stay_out_of_histories_and_logs(http_orders):
    """An upstream URL with userinfo and a query-string token, that cannot be reached: the call
    is not performed (nothing was sent), and neither secret is in the operation's history or
    the proxy's log."""
    tmp, stack = http_orders.tmp, http_orders.stack
    dead = free_port()
    port, log = serve_proxy(tmp, stack, "--listen", "127.0.0.1:0",
                            "--upstream", f"http://orders:pa55word@127.0.0.1:{dead}/mcp?token=s3cretq", name="leaky")
    status, body = request(f"http://127.0.0.1:{port}/mcp", http_call("u-1"))
    assert status == 200 and b"not performed" in body, body
    ledger = f"http://127.0.0.1:{stack.ledger_port}"
    listed = subprocess.run([str(BIN / "oncectl"), "list", "--all", "--json", "--addr", ledger],
                            capture_output=True, text=True, check=True)
    (operation,) = json.loads(listed.stdout)["operations"]
    assert operation["state"] == "ABSENT", operation
    shown = subprocess.run([str(BIN / "oncectl"), "show", operation["operation_id"], "--json", "--addr", ledger],
                           capture_output=True, text=True, check=True).stdout
    assert "could not be reached" in shown, shown
    for text in (shown, log.read_text()):
        assert "pa55word" not in text and "s3cretq" not in text and "orders:" not in text, text
