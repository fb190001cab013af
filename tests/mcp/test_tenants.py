"""Two MCP servers of two tenants share one ledger and the same order ids."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.anyio


def text(result, index: int = 0) -> str:
    return result.content[index].text


async def refund(session, order_id: str = "order_4821"):
    return await session.call_tool(
        "issue_refund", {"order_id": order_id, "amount_cents": 500, "currency": "eur"}
    )


async def status(session, order_id: str = "order_4821") -> dict:
    result = await session.call_tool("get_refund_status", {"order_id": order_id})
    assert not result.is_error, text(result)
    return json.loads(text(result))


async def test_two_tenants_refund_the_same_order_once_each_and_see_only_their_own(tenant_stack):
    ports = {tenant: tenant_stack.start_tenant_refund_http(tenant) for tenant in ("acme", "globex")}

    refunds = {}
    for tenant, port in ports.items():
        async with tenant_stack.session_at(port) as session:
            first = await refund(session)
            assert not first.is_error, text(first)
            again = await refund(session)
            assert not again.is_error, text(again)
            assert text(again) == text(first), "each tenant's retry replays its own refund"
            assert json.loads(text(again, 1))["replayed"] is True
            refunds[tenant] = json.loads(text(first))["refund_id"]

    # One refund each: their provider idempotency keys differ, or the provider would have
    # replayed the first tenant's refund to the second.
    assert refunds["acme"] != refunds["globex"]
    assert tenant_stack.stats()["refunds"] == 2

    # The same operation id in each tenant, each with its own refund and its one attempt.
    seen = {}
    for tenant, port in ports.items():
        async with tenant_stack.session_at(port) as session:
            seen[tenant] = await status(session)
        assert seen[tenant]["state"] == "CONFIRMED"
        assert seen[tenant]["refund"]["refund_id"] == refunds[tenant]
        assert len(seen[tenant]["attempts"]) == 1, seen[tenant]
    assert seen["acme"]["operation_id"] == seen["globex"]["operation_id"]

    # A server without a key is refused by the ledger: nothing is performed.
    keyless = tenant_stack.start_tenant_refund_http(None)
    async with tenant_stack.session_at(keyless) as session:
        refused = await refund(session, "order_9999")
    assert refused.is_error
    assert "NOT performed" in text(refused) and "CREDENTIALS_MISSING" in text(refused)
    assert tenant_stack.stats()["refunds"] == 2
