"""The refund MCP server guarded by once-ledger, driven by the official MCP SDK for Python."""

from __future__ import annotations

import json
import time

import anyio
import pytest

from conftest import PATIENCE, wait_for

pytestmark = pytest.mark.anyio


def text(result, index: int = 0) -> str:
    return result.content[index].text


async def refund(session, order_id: str = "order_4821", amount_cents: int = 500, **extra):
    arguments = {"order_id": order_id, "amount_cents": amount_cents, "currency": "eur", **extra}
    return await session.call_tool("issue_refund", arguments)


async def status(session, order_id: str = "order_4821") -> dict:
    result = await session.call_tool("get_refund_status", {"order_id": order_id})
    assert not result.is_error, text(result)
    return json.loads(text(result))


async def test_same_refund_twice_is_one_refund_and_a_verbatim_replay(stack):
    async with stack.session() as session:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        assert tools["issue_refund"].annotations.destructive_hint is True
        assert tools["issue_refund"].annotations.idempotent_hint is True
        first = await refund(session)
        assert not first.is_error, text(first)
        second = await refund(session)
    assert not second.is_error
    assert text(second) == text(first), "the replay is the original result, verbatim"
    marker = json.loads(text(second, 1))
    assert marker["replayed"] is True
    assert marker["operation_id"] == json.loads(text(first))["operation_id"]
    assert marker["original_time"]
    assert stack.stats()["refunds"] == 1


async def test_commit_then_dropped_response_is_unknown_and_never_refunds_again(stack):
    stack.faults(write="commit_then_drop")
    async with stack.session() as session:
        first = await refund(session)
        assert first.is_error
        assert "being verified" in text(first) and "Do not retry" in text(first)
        stack.faults()
        again = await refund(session)
        assert again.is_error and "being verified" in text(again)
        assert (await status(session))["state"] == "UNKNOWN"
    assert stack.stats()["refunds"] == 1


async def test_two_concurrent_calls_are_one_refund(stack):
    stack.faults(delay_ms=700)
    results = []
    async with stack.session() as session:
        async def call():
            results.append(await refund(session))

        async with anyio.create_task_group() as group:
            group.start_soon(call)
            group.start_soon(call)
    succeeded = [r for r in results if not r.is_error]
    assert len(succeeded) >= 1
    others = [r for r in results if r is not succeeded[0]]
    for other in others:
        if other.is_error:
            assert "already in progress" in text(other) and "get_refund_status" in text(other)
        else:
            assert text(other) == text(succeeded[0])
    assert stack.stats()["refunds"] == 1


async def test_same_order_with_a_different_amount_is_a_conflict(stack):
    async with stack.session() as session:
        first = await refund(session, amount_cents=500)
        assert not first.is_error
        conflict = await refund(session, amount_cents=900)
    assert conflict.is_error
    assert "different arguments" in text(conflict)
    assert stack.stats()["refunds"] == 1


async def test_ledger_down_means_not_performed(stack):
    stack.ledger.kill()
    async with stack.session() as session:
        result = await refund(session)
    assert result.is_error
    assert "NOT performed" in text(result) and "safe to retry later" in text(result)
    assert stack.stats()["refund_requests"] == 0, "nothing reached the provider"


async def test_refund_mcp_killed_after_the_provider_committed(stack):
    stack.faults(write="commit_then_stall")

    async def call_and_die():
        with pytest.raises(Exception):
            async with stack.session() as session:
                await refund(session)

    async with anyio.create_task_group() as group:
        group.start_soon(call_and_die)
        await anyio.to_thread.run_sync(lambda: wait_for("the provider to commit", lambda: stack.stats()["refunds"] == 1))
        stack.kill_refund_mcp()
    stack.faults()
    if stack.transport == "http":
        stack.start_refund_http()
    async with stack.session() as session:
        deadline = time.monotonic() + 20 * PATIENCE
        while (await status(session))["state"] != "UNKNOWN":
            assert time.monotonic() < deadline, "the lease should expire into UNKNOWN"
            await anyio.sleep(0.1)
        result = await refund(session)
    assert result.is_error and "being verified" in text(result)
    assert stack.stats()["refunds"] == 1


async def test_explicit_idempotency_keys(stack):
    async with stack.session() as session:
        a = await refund(session, idempotency_key="key-a")
        b = await refund(session, idempotency_key="key-b")
        a_again = await refund(session, idempotency_key="key-a")
    assert not a.is_error and not b.is_error
    assert json.loads(text(a))["refund_id"] != json.loads(text(b))["refund_id"]
    assert text(a_again) == text(a)
    assert json.loads(text(a_again, 1))["replayed"] is True
    assert stack.stats()["refunds"] == 2


async def test_attempts_record_where_the_call_came_from(stack):
    async with stack.session() as session:
        await refund(session)
        attempts = (await status(session))["attempts"]
    assert len(attempts) == 1
    attempt = attempts[0]
    assert attempt["client"], "the MCP client's name from its handshake"
    assert attempt["request_id"], "the JSON-RPC request id"
    if stack.transport == "http":
        assert attempt["session_id"], "the MCP session id of Streamable HTTP"


async def test_progress_is_reported_while_the_refund_runs(stack):
    stack.faults(delay_ms=2500)
    notes = []

    async def on_progress(progress, total, message):
        notes.append((progress, message))

    async with stack.session() as session:
        result = await session.call_tool(
            "issue_refund",
            {"order_id": "order_slow", "amount_cents": 100, "currency": "eur"},
            progress_callback=on_progress,
        )
    assert not result.is_error, text(result)
    assert notes and notes[0][1] == "refund in progress"


async def test_a_settled_refunds_status_carries_a_receipt_that_verifies_with_the_public_key_alone(stack, tmp_path):
    import subprocess

    from conftest import BIN

    async with stack.session() as session:
        first = await refund(session)
        assert not first.is_error, text(first)
        # The receipt is signed once the history's chain has linked the refund's confirmation,
        # within about a second; until then the status has none.
        deadline = time.monotonic() + 20 * PATIENCE
        found = await status(session)
        while "receipt" not in found and time.monotonic() < deadline:
            await anyio.sleep(0.1)
            found = await status(session)
    assert found["state"] == "CONFIRMED"
    receipt = found["receipt"]
    assert receipt.startswith("r1."), found
    keys = json.loads(stack.onced_command("signing-keys", "--signing-key-file", str(stack.signing_key_file), "--json"))
    public = keys[0]["public_key"]
    stack.stop_ledger()

    def verify(text: str) -> subprocess.CompletedProcess:
        path = tmp_path / "refund.receipt"
        path.write_text(text)
        # No ledger to reach: nothing listens at this address, and none is needed.
        return subprocess.run(
            [str(BIN / "oncectl"), "--addr", "http://127.0.0.1:1", "-o", "json",
             "receipt", "verify", str(path), "--public-key", public],
            capture_output=True, text=True, timeout=60,
        )

    verified = verify(receipt)
    assert verified.returncode == 0, verified.stderr
    said = json.loads(verified.stdout)
    assert (said["state"], said["operation_id"]) == ("CONFIRMED", found["operation_id"])
    assert said["provider_ref"] == found["refund"]["refund_id"], (said, found)
    # One character of the signed content changed: it does not verify.
    at = len("r1.") + 20
    tampered = receipt[:at] + ("A" if receipt[at] != "A" else "B") + receipt[at + 1:]
    refused = verify(tampered)
    assert refused.returncode == 5, refused.stderr
    assert "does not verify" in refused.stderr
