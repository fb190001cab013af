"""UNKNOWN refunds settled from provider truth, seen through the MCP tools."""

from __future__ import annotations

import json
import time

import anyio
import pytest

from conftest import PATIENCE
from test_refund import refund, status, text

pytestmark = pytest.mark.anyio


async def wait_state(session, order_id: str, state: str, limit: float = 20.0) -> dict:
    deadline = time.monotonic() + limit * PATIENCE
    while True:
        current = await status(session, order_id)
        if current["state"] == state:
            return current
        assert time.monotonic() < deadline, f"{order_id} stayed {current['state']}, expected {state}"
        await anyio.sleep(0.1)


async def test_lost_response_is_reconciled_and_the_next_call_replays_it(reconciled_stack):
    stack = reconciled_stack
    stack.faults(write="commit_then_drop", write_times=1)
    async with stack.session() as session:
        first = await refund(session, "order_77")
        assert first.is_error and "being verified" in text(first)
        settled = await wait_state(session, "order_77", "CONFIRMED")
        assert settled["refund"]["metadata"]["once_operation_id"] == settled["operation_id"]
        again = await refund(session, "order_77")
    assert not again.is_error, text(again)
    provider_refund = json.loads(text(again))
    assert provider_refund["id"] == settled["refund"]["id"]
    assert json.loads(text(again, 1))["replayed"] is True
    assert stack.stats()["refunds"] == 1


async def test_ambiguous_failure_without_effect_is_reconciled_absent_and_runs_once(reconciled_stack):
    stack = reconciled_stack
    stack.faults(write="fail_before_commit", write_times=1)
    async with stack.session() as session:
        first = await refund(session, "order_78")
        assert first.is_error and "being verified" in text(first)
        await wait_state(session, "order_78", "ABSENT")
        again = await refund(session, "order_78")
        assert not again.is_error, text(again)
        once_more = await refund(session, "order_78")
    assert text(once_more) == text(again)
    assert stack.stats()["refunds"] == 1
