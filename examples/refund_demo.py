"""The five-minute walkthrough: an MCP client calls the refund tool twice, then meets a lost
response that the ledger's reconciler settles. Needs onced (with examples/onced.toml), fakepay
and `refund-mcp --http 127.0.0.1:8000` running (see README). Each run refunds orders of its own
(`order_<run>_1001`, `order_<run>_1002`) and clears fakepay's faults first, so it can be run
again against the same processes."""

import argparse
import asyncio
import json
import secrets
import urllib.request

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client


def provider(url: str, path: str, body=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, method="POST" if data else "GET",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


def show(label: str, result, gap: bool = True) -> None:
    kind = "ERROR" if result.is_error else "ok"
    print(f"{chr(10) if gap else ''}{label} [{kind}]")
    for block in result.content:
        print("   ", block.text)


async def main(mcp_url: str, provider_url: str) -> None:
    # A run of its own: fresh orders, no fault left over from a run cut short, and the refunds
    # counted from here.
    run = secrets.token_hex(2)
    first, second = f"order_{run}_1001", f"order_{run}_1002"
    provider(provider_url, "/_fakepay/faults", {})
    before = provider(provider_url, "/_fakepay/stats")["refunds"]

    def refunds() -> None:
        made = provider(provider_url, "/_fakepay/stats")["refunds"] - before
        print(f"\n   refunds at the provider: {made}")

    async with streamable_http_client(mcp_url) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            refund = {"order_id": first, "amount_cents": 2500, "currency": "eur"}

            show(f"1. issue_refund({first})", await session.call_tool("issue_refund", refund))
            show("2. the same call again (a retry, or the model calling twice)",
                 await session.call_tool("issue_refund", refund))
            refunds()

            provider(provider_url, "/_fakepay/faults", {"write": "commit_then_drop", "write_times": 1})
            print("\n3. the provider will now commit the next refund and drop the connection")
            lost = {"order_id": second, "amount_cents": 900, "currency": "eur"}
            show(f"   issue_refund({second})", await session.call_tool("issue_refund", lost), gap=False)
            show("4. calling again does not refund again", await session.call_tool("issue_refund", lost))
            show(f"5. get_refund_status({second})",
                 await session.call_tool("get_refund_status", {"order_id": second}))
            refunds()

            print("\n6. waiting for the reconciler to look the refund up at the provider…")
            for _ in range(60):
                status = await session.call_tool("get_refund_status", {"order_id": second})
                state = json.loads(status.content[0].text)["state"]
                if state != "UNKNOWN":
                    break
                await asyncio.sleep(0.5)
            print(f"   {second} is now {state}")
            show(f"7. issue_refund({second}) again: the provider's refund, replayed",
                 await session.call_tool("issue_refund", lost))
            refunds()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mcp", default="http://127.0.0.1:8000/mcp")
    parser.add_argument("--provider", default="http://127.0.0.1:12111")
    args = parser.parse_args()
    asyncio.run(main(args.mcp, args.provider))
