"""Local effects through booking-mcp: each booking and a marker naming its attempt commit in the
server's own database, and the ledger's `sql` reconciler reads the marker. A campaign of random
kills of the server (and, on PostgreSQL, of its database connections) ends with every operation
CONFIRMED or ABSENT, none UNKNOWN, and exactly one booking for each CONFIRMED one."""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import uuid

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client

from conftest import BIN, PATIENCE, POSTGRES, make_stack, psql, wait_for

pytestmark = pytest.mark.anyio


def rows(url: str, sql: str) -> list[tuple]:
    """What `sql` reads from the database at `url`."""
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://").split("?")[0]
        with sqlite3.connect(path) as db:
            return db.execute(sql).fetchall()
    done = subprocess.run(["psql", url, "-tAc", sql], capture_output=True, text=True, check=True)
    return [tuple(line.split("|")) for line in done.stdout.splitlines() if line]


class Local:
    """A ledger whose `sql` reconciler reads booking-mcp's database, and how to start it."""

    def __init__(self, tmp_path, backend):
        self.backend = backend
        if backend == "sqlite":
            path = tmp_path / "bookings.db"
            self.app_url = f"sqlite://{path}?mode=rwc"
            endpoint = f"sqlite://{path}?mode=rwc"
            self.pg_name = None
        else:
            self.pg_name = f"once_app_{uuid.uuid4().hex}"
            psql(f"CREATE DATABASE {self.pg_name}")
            self.app_url = POSTGRES.rsplit("/", 1)[0] + "/" + self.pg_name
            endpoint = self.app_url
        config = (
            "[reconciliation]\ninterval = \"100ms\"\nfirst_backoff = \"100ms\"\nmax_backoff = \"500ms\"\n\n"
            f"[[reconciler]]\nname = \"bookings\"\nkind = \"sql\"\nendpoint = \"{endpoint}\"\ntimeout = \"2s\"\n"
        )
        self.stack = make_stack(tmp_path, backend, "none", reconcile=False, config=config)

    def params(self, instance: str) -> StdioServerParameters:
        return StdioServerParameters(
            command=str(BIN / "booking-mcp"),
            args=["--ledger", f"http://127.0.0.1:{self.stack.ledger_port}", "--database-url", self.app_url,
                  "--lease-ttl", "1s", "--instance", instance],
        )

    def close(self):
        self.stack.close()
        if self.pg_name:
            psql(f"DROP DATABASE IF EXISTS {self.pg_name} WITH (FORCE)")


@pytest.fixture
def local(tmp_path, backend):
    local = Local(tmp_path, backend)
    try:
        yield local
    finally:
        local.close()


async def test_a_booking_runs_once_and_a_repeat_replays_it(local):
    async with stdio_client(local.params(f"booking-mcp-{uuid.uuid4().hex}")) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            arguments = {"slot": "mon-9/room-3", "who": "ada"}
            first = await session.call_tool("book_slot", arguments)
            assert not first.is_error, first.content[0].text
            again = await session.call_tool("book_slot", arguments)
            assert again.content[0].text == first.content[0].text, "the repeat replays the booking"
            status = json.loads((await session.call_tool("get_booking_status", {"slot": "mon-9/room-3"})).content[0].text)
    assert status["state"] == "CONFIRMED"
    assert status["booking"]["who"] == "ada"
    assert rows(local.app_url, "SELECT count(*) FROM bookings")[0][0] in (1, "1")


async def test_a_campaign_of_kills_leaves_every_booking_confirmed_or_absent_and_none_twice(local, backend):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"campaign seed {seed}")
    for i in range(24):
        instance = f"booking-mcp-{uuid.uuid4().hex}"
        kill_after = rng.choice([None, 0.0, 0.005, 0.02, 0.05, 0.1])
        kill_connections = backend == "postgres" and rng.random() < 0.3
        try:
            with anyio.move_on_after(20 * PATIENCE):
                async with stdio_client(local.params(instance)) as (read, write):
                    async with ClientSession(read, write) as session:
                        await session.initialize()
                        async with anyio.create_task_group() as group:
                            group.start_soon(session.call_tool, "book_slot", {"slot": f"slot-{i}", "who": f"guest-{i}"})
                            if kill_connections:
                                await anyio.sleep(rng.choice([0.0, 0.005, 0.02]))
                                psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                     f"WHERE datname = '{local.pg_name}' AND pid <> pg_backend_pid()")
                            if kill_after is not None:
                                await anyio.sleep(kill_after)
                                subprocess.run(["pkill", "-9", "-f", instance], check=False)
        except Exception:
            # The server was killed under the call: what it did is for the ledger to settle.
            pass
        subprocess.run(["pkill", "-9", "-f", instance], check=False)

    ledger = local.stack.database_url

    def open_operations():
        left = rows(ledger, "SELECT count(*) FROM operations WHERE state IN ('UNKNOWN', 'IN_FLIGHT')")[0][0]
        return int(left) == 0 or None

    wait_for("every booking settled", open_operations, limit=60 * PATIENCE)
    states = dict((state, int(count)) for state, count in rows(ledger, "SELECT state, count(*) FROM operations GROUP BY state"))
    print("settled by", rows(ledger, "SELECT source, state, count(*) FROM operations GROUP BY source, state"))
    print(f"campaign seed {seed}: {states}")
    assert set(states) <= {"CONFIRMED", "ABSENT"}, (seed, states)
    confirmed = sorted(ref for (ref,) in rows(ledger, "SELECT provider_ref FROM operations WHERE state = 'CONFIRMED'"))
    booked = sorted(booking for (booking,) in rows(local.app_url, "SELECT booking_id FROM bookings"))
    assert booked == confirmed, (seed, states, booked, confirmed)
