"""Tool-call latency through once-proxy against the same calls made directly, over stdio, with
the official Python MCP SDK as the client and the test suite's Python upstream
(`tests/mcp/upstreams/orders_server.py`). Starts its own onced on a fresh SQLite file (or the
PostgreSQL database named with --postgres). Prints p50 and p99 of each kind of call; asserts
nothing.

    .venv/bin/python bench/proxy_latency.py [--calls 500] [--bin-dir target/release] [--postgres URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mcp import ClientSession, StdioServerParameters, stdio_client

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ROOT / "tests" / "mcp" / "upstreams" / "orders_server.py"
POLICY = """
[tools.place_order]
intent = ["order", "{/order_id}"]
"""


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


async def measure(params: StdioServerParameters, calls: int, label: str) -> dict[str, list[float]]:
    seen: dict[str, list[float]] = {"unguarded": [], "guarded": []}
    async with stdio_client(params, errlog=open(os.devnull, "w")) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            # Warm both paths first.
            await session.call_tool("get_order", {"order_id": "warm"})
            await session.call_tool("place_order", {"order_id": f"{label}-warm", "amount_cents": 1})
            for n in range(calls):
                started = time.perf_counter()
                await session.call_tool("get_order", {"order_id": "none"})
                seen["unguarded"].append(time.perf_counter() - started)
                started = time.perf_counter()
                result = await session.call_tool("place_order", {"order_id": f"{label}-{n}", "amount_cents": 1})
                seen["guarded"].append(time.perf_counter() - started)
                assert not result.is_error, result
    return seen


def start_ledger(bin_dir: Path, database_url: str, log: Path) -> tuple[subprocess.Popen, int]:
    ledger = subprocess.Popen(
        [str(bin_dir / "onced"), "--database-url", database_url, "--listen", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL, stderr=open(log, "w"),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"onced serving.*address=\S*:(\d+)", log.read_text())
        if found:
            return ledger, int(found.group(1))
        assert ledger.poll() is None, log.read_text()
        time.sleep(0.05)
    raise SystemExit("onced did not start")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--bin-dir", type=Path, default=ROOT / "target" / "release")
    parser.add_argument("--postgres", help="a PostgreSQL database URL for onced; a fresh SQLite file if not given")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        effects = tmp / "effects.jsonl"
        policy = tmp / "policy.toml"
        policy.write_text(POLICY)
        database_url = args.postgres or f"sqlite://{tmp / 'ledger.db'}"
        ledger, port = start_ledger(args.bin_dir, database_url, tmp / "onced.log")
        try:
            env = {"ORDERS_EFFECTS": str(effects)}
            direct = StdioServerParameters(command=sys.executable, args=[str(UPSTREAM)], env=env)
            proxied = StdioServerParameters(
                command=str(args.bin_dir / "once-proxy"),
                args=["--policy", str(policy), "--ledger", f"http://127.0.0.1:{port}", "--",
                      sys.executable, str(UPSTREAM)],
                env=env,
            )
            run = f"{os.getpid()}-{time.time_ns()}"
            figures = {
                "direct": await measure(direct, args.calls, f"direct-{run}"),
                "through once-proxy": await measure(proxied, args.calls, f"proxied-{run}"),
            }
        finally:
            ledger.terminate()
            ledger.wait(timeout=10)

    store = "PostgreSQL" if args.postgres else "SQLite"
    print(f"{args.calls} sequential calls of each kind over stdio, 1 client; onced on {store}")
    print(f"{'path':<20} {'call':<34} {'p50 ms':>8} {'p99 ms':>8}")
    kinds = {
        "unguarded": "get_order (passes through)",
        "guarded": "place_order (fresh operation)",
    }
    for path, seen in figures.items():
        for kind, what in kinds.items():
            values = seen[kind]
            print(f"{path:<20} {what:<34} {percentile(values, 50) * 1e3:>8.2f} {percentile(values, 99) * 1e3:>8.2f}")
    for kind, what in kinds.items():
        added = percentile(figures["through once-proxy"][kind], 50) - percentile(figures["direct"][kind], 50)
        print(f"the proxy adds to {what}: p50 {added * 1e3:+.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
