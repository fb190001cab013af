"""The restore drill: the ledger's database is put back to an older copy while refund-mcp keeps
what it saw; nothing it saw runs twice, and what the ledger lost comes back from provider truth."""

from __future__ import annotations

import json
import time

import anyio
import pytest

from conftest import PATIENCE, make_stack
from test_refund import refund, status, text

pytestmark = pytest.mark.anyio

ORDERS = ["drill_1", "drill_2", "drill_3"]


async def answered(stack, order_id: str, limit: float = 30.0):
    """Calls the refund until it is answered without an error: replayed, or performed."""
    deadline = time.monotonic() + limit * PATIENCE
    while True:
        async with stack.session() as session:
            answer = await refund(session, order_id)
        if not answer.is_error:
            return answer
        assert time.monotonic() < deadline, f"{order_id} never replayed: {text(answer)}"
        await anyio.sleep(0.2)


async def test_a_restored_ledger_refuses_what_refund_mcp_saw_and_its_reconciler_settles_it(tmp_path, backend):
    stack = make_stack(tmp_path, backend, "stdio", reconcile=True)
    stack.state_file = tmp_path / "refund-mcp" / "positions"
    try:
        # The backup is of the ledger before the three refunds.
        stack.stop_ledger()
        stack.back_up()
        stack.start_ledger()
        async with stack.session() as session:
            originals = {}
            for order in ORDERS:
                answer = await refund(session, order)
                assert not answer.is_error, text(answer)
                originals[order] = json.loads(text(answer))
        assert stack.stats()["refunds"] == 3

        # The database is restored: the ledger has never heard of the three refunds.
        stack.stop_ledger()
        stack.restore()
        stack.start_ledger()
        async with stack.session() as session:
            again = await refund(session, "drill_2")
        assert again.is_error
        assert "NOT performed" in text(again) and "restored" in text(again), text(again)
        assert stack.stats()["refunds"] == 3, "a refund the ledger lost ran again"

        shown = json.loads(stack.onced_command("continuity", "status", "--json"))
        held = [t for t in shown["tenants"] if t["held"]]
        assert [t["tenant"] for t in held] == ["default"], shown
        assert held[0]["held"]["why"] == "TOKEN_AHEAD"

        # refund-mcp reported what it kept: the lost refunds are UNKNOWN (or already settled
        # by the reconciler), never new.
        async with stack.session() as session:
            for order in ORDERS:
                current = await status(session, order)
                assert current["state"] in ("UNKNOWN", "CONFIRMED"), current

        accepted = json.loads(stack.onced_command(
            "continuity", "accept", "--reason", "restored the copy taken before the drill", "--json",
        ))
        assert [a["tenant"] for a in accepted] == ["default"]
        assert accepted[0]["actor"].startswith("operator:onced-cli@")

        # The stripe reconciler finds each refund at fakepay by its provider key and settles it
        # CONFIRMED: the next call replays the original refund, and fakepay still counts three.
        for order in ORDERS:
            answer = await answered(stack, order)
            # The reconciler's result: fakepay's refund object, the very refund made before.
            assert json.loads(text(answer))["id"] == originals[order]["refund_id"]
            assert json.loads(text(answer, 1))["replayed"] is True
        assert stack.stats()["refunds"] == 3
        # And new refunds run again, once every replica has read the acceptance.
        fresh = await answered(stack, "drill_4")
        assert json.loads(text(fresh))["order_id"] == "drill_4"
        assert stack.stats()["refunds"] == 4
    finally:
        stack.close()


async def test_through_once_proxy_a_restored_ledger_performs_nothing_the_proxy_saw_again(tmp_path, backend):
    from test_proxy import Orders, texts

    stack = make_stack(tmp_path, backend, "none", reconcile=False)
    orders = Orders(stack, tmp_path, "python")
    orders.flags = ["--state-file", str(tmp_path / "proxy" / "positions")]
    try:
        stack.stop_ledger()
        stack.back_up()
        stack.start_ledger()
        async with orders.session() as session:
            for order in ("p-1", "p-2"):
                answer = await session.call_tool("place_order", {"order_id": order, "amount_cents": 500})
                assert not answer.is_error, texts(answer)
        assert len(orders.placed()) == 2

        stack.stop_ledger()
        stack.restore()
        stack.start_ledger()
        # A new proxy process, reading what the one before kept.
        async with orders.session() as session:
            again = await session.call_tool("place_order", {"order_id": "p-1", "amount_cents": 500})
        assert again.is_error, texts(again)
        assert "NOT performed" in " ".join(texts(again)), texts(again)
        assert len(orders.placed("p-1")) == 1, "an order the ledger lost was placed again"

        stack.onced_command("continuity", "accept", "--reason", "restored the copy taken before the drill")
        deadline = time.monotonic() + 20 * PATIENCE
        async with orders.session() as session:
            while True:
                fresh = await session.call_tool("place_order", {"order_id": "p-3", "amount_cents": 500})
                if not fresh.is_error:
                    break
                assert time.monotonic() < deadline, texts(fresh)
                await anyio.sleep(0.2)
            # What the proxy reported is UNKNOWN (no reconciler here): never placed again.
            for order in ("p-1", "p-2"):
                answer = await session.call_tool("place_order", {"order_id": order, "amount_cents": 500})
                assert answer.is_error and "being verified" in " ".join(texts(answer)), texts(answer)
        assert [len(orders.placed(order)) for order in ("p-1", "p-2", "p-3")] == [1, 1, 1]
    finally:
        stack.close()
