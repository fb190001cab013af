"""An MCP server that knows nothing of once-ledger: the Python upstream once-proxy is tested in
front of, on FastMCP (`--framework fastmcp`, the standalone package) or on the official Python
SDK's MCPServer (the default).

Every order it places is one line appended to the file `ORDERS_EFFECTS` names, with the JSON-RPC
id of the request it came in: the side effects the tests count. `place_typed_order` declares an
output schema, and breaks it for an amount of 13 cents after its effect (an SDK's output validation
runs after the tool). While the file `ORDERS_HOLD` names exists, `place_order` waits after recording
its effect, as a server that is slow or dies mid-call after its effect; it records that it is
answering just before it does. Run it over stdio (the default) or over Streamable HTTP with
`--http PORT`, where `GET /orders/{order_id}?key=KEY` is the lookup route a reconciler reads (200
with the order placed under that idempotency key, 404 when there is none)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing_extensions import TypedDict

FASTMCP = "--framework" in sys.argv and sys.argv[sys.argv.index("--framework") + 1] == "fastmcp"

if FASTMCP:
    from fastmcp import Context, FastMCP
    from fastmcp.exceptions import ToolError

    server = FastMCP("orders")
    # No output schema: a result a reconciler stored from the lookup route is replayed as it is.
    PLACING = {"output_schema": None}
    READING = {"annotations": {"readOnlyHint": True}}
else:
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import ToolAnnotations

    server = MCPServer("orders")
    PLACING = {"structured_output": False}
    READING = {"annotations": ToolAnnotations(readOnlyHint=True)}

EFFECTS = Path(os.environ["ORDERS_EFFECTS"])
HOLD = Path(os.environ.get("ORDERS_HOLD", "/nonexistent"))


class Placed(TypedDict):
    order_id: str
    amount_cents: int


def record(order_id: str, amount_cents: int, key: str, ctx: Context) -> None:
    with EFFECTS.open("a") as effects:
        effects.write(json.dumps({"order_id": order_id, "amount_cents": amount_cents, "key": key,
                                  "pid": os.getpid(), "request_id": ctx.request_id}) + "\n")


def placed() -> list[dict]:
    if not EFFECTS.exists():
        return []
    lines = [json.loads(line) for line in EFFECTS.read_text().splitlines() if line.strip()]
    return [line for line in lines if "order_id" in line]


@server.tool(description="Place an order: charges the customer.", **PLACING)
async def place_order(order_id: str, amount_cents: int, ctx: Context, note: str = "", idempotency_key: str = "") -> str:
    if amount_cents <= 0:
        raise ToolError(f"amount_cents must be positive, not {amount_cents}")
    await ctx.report_progress(0.5, 1.0, "charging")
    record(order_id, amount_cents, idempotency_key, ctx)
    try:
        while HOLD.exists():
            await asyncio.sleep(0.02)
    except asyncio.CancelledError:
        # The client's cancellation reached this server: say so where the tests look.
        with EFFECTS.open("a") as effects:
            effects.write(json.dumps({"cancelled": order_id}) + "\n")
        raise
    with EFFECTS.open("a") as effects:
        effects.write(json.dumps({"answering": order_id}) + "\n")
    return f"order {order_id} placed for {amount_cents} cents (#{len(placed())})"


@server.tool(description="Place an order and return it as structured output.")
async def place_typed_order(order_id: str, amount_cents: int, ctx: Context) -> Placed:
    record(order_id, amount_cents, "", ctx)
    if amount_cents == 13:
        return {"order_id": order_id}  # type: ignore[typeddict-item]
    return {"order_id": order_id, "amount_cents": amount_cents}


@server.tool(description="Look an order up.", **READING)
def get_order(order_id: str) -> str:
    found = [o for o in placed() if o["order_id"] == order_id]
    return json.dumps(found[-1]) if found else "no such order"


@server.custom_route("/orders/{order_id}", methods=["GET"])
async def lookup(request):
    from starlette.responses import JSONResponse

    key = request.query_params.get("key")
    found = [o for o in placed()
             if o["order_id"] == request.path_params["order_id"] and (key is None or o["key"] == key)]
    if not found:
        return JSONResponse({"error": "no such order"}, status_code=404)
    return JSONResponse({"id": f"ord_{found[-1]['order_id']}", **found[-1]})


if __name__ == "__main__":
    if "--http" in sys.argv:
        port = int(sys.argv[sys.argv.index("--http") + 1])
        if FASTMCP:
            server.run("http", host="127.0.0.1", port=port, show_banner=False)
        else:
            server.run("streamable-http", host="127.0.0.1", port=port)
    elif FASTMCP:
        server.run(show_banner=False)
    else:
        server.run()
