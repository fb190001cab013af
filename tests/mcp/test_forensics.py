"""Duplicate forensics on histories made by a real MCP client: the official Python MCP SDK
drives refund-mcp over Streamable HTTP the ways duplicates arise — the same call again in one
session, a new session, a new idempotency key for the same refund — and `oncectl` says where
each repeated call came from."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import BIN, make_stack, wait_for

pytestmark = pytest.mark.anyio


@pytest.fixture
def http_stack(tmp_path, backend):
    stack = make_stack(tmp_path, backend, "http", reconcile=False)
    try:
        yield stack
    finally:
        stack.close()


def oncectl(stack, *args: str) -> dict:
    done = subprocess.run(
        [str(BIN / "oncectl"), "--addr", f"http://127.0.0.1:{stack.ledger_port}", "-o", "json", *args],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def refund(session, order_id: str, **extra):
    arguments = {"order_id": order_id, "amount_cents": 500, "currency": "eur", **extra}
    return await session.call_tool("issue_refund", arguments)


def origins(stack, operation_id: str, calls: int) -> list[tuple[str, str | None]]:
    """The decision and origin of each call of the operation, once `calls` are recorded."""
    shown = wait_for(
        f"{calls} calls of {operation_id}",
        lambda: (lambda s: s if len(s["calls"]) >= calls else None)(oncectl(stack, "show", operation_id)),
    )
    return [(call["decision"], call["origin"]) for call in shown["calls"]]


async def test_each_kind_of_duplicate_is_told_apart(http_stack):
    stack = http_stack
    async with stack.session() as session:
        first = await refund(session, "order_31")
        assert not first.is_error
        # The same call again in the same session, at once: what a harness's retry does.
        again = await refund(session, "order_31")
        assert json.loads(again.content[1].text)["replayed"] is True
    # A new session replays the call: what a client that reconnected does.
    async with stack.session() as session:
        replayed = await refund(session, "order_31")
        assert not replayed.is_error
    operation = json.loads(first.content[0].text)["operation_id"]
    assert origins(stack, operation, 3) == [
        ("EXECUTE", None),
        ("REPLAY", "harness_retry"),
        ("REPLAY", "reconnect"),
    ]

    # The provider commits and the answer is lost: UNKNOWN. The model then tries a fresh key for
    # the same refund; the fresh-id guard stops it.
    stack.faults(write="commit_then_drop")
    async with stack.session() as session:
        lost = await refund(session, "order_32")
        assert lost.is_error and "being verified" in lost.content[0].text
        stack.faults()
        reissued = await refund(session, "order_32", idempotency_key="a-fresh-key")
        assert reissued.is_error and "being verified" in reissued.content[0].text
    unknown = oncectl(stack, "list")["operations"]
    assert len(unknown) == 1
    blocked = unknown[0]["operation_id"]
    assert origins(stack, blocked, 2) == [("EXECUTE", None), ("UNKNOWN", "model_reissue")]
    shown = oncectl(stack, "show", blocked)
    assert shown["calls"][1]["requested_operation_id"] != blocked
    assert stack.stats()["refunds"] == 2, "one refund each"

    window = oncectl(stack, "forensics", "--since", "1h", "--tool", "issue_refund")
    assert window["operations"] == 2
    assert window["prevented"] == 3
    assert window["origins"] == {"harness_retry": 1, "reconnect": 1, "model_reissue": 1}
    assert "3 duplicates prevented" in window["summary"]
