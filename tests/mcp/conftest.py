"""Harness for the MCP tests: real onced, fakepay and refund-mcp processes, driven by the
official MCP SDK for Python over stdio and Streamable HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("ONCE_BIN_DIR", ROOT / "target" / "debug"))
POSTGRES = os.environ.get("ONCE_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How much longer than its stated limit every wait may take (as in the Rust suite).
PATIENCE = max(1.0, float(os.environ.get("ONCE_TEST_PATIENCE", "1")))


def wait_for(what: str, probe, limit: float = 20.0):
    """Polls `probe` until it returns a truthy value; fails the test after `limit` seconds
    (scaled by `ONCE_TEST_PATIENCE`)."""
    deadline = time.monotonic() + limit * PATIENCE
    pause = 0.01
    while True:
        try:
            value = probe()
            if value:
                return value
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def served_port(log: Path, announcement: str, before: int) -> int | None:
    """The port in the `address=` field of the first line saying `announcement` after the
    `before` such lines already in `log`, once it is there. Servers are started on port 0 and
    say where they listen: a port picked in advance could be taken meanwhile (an outgoing
    connection's local port is drawn from the same range)."""
    lines = [line for line in log.read_text().splitlines() if announcement in line] if log.exists() else []
    if len(lines) <= before:
        return None
    found = re.search(r"address=\S*:(\d+)", lines[before])
    assert found, f"{log.name} says {announcement!r} without an address: {lines[before]}"
    return int(found.group(1))


def announcements(log: Path, announcement: str) -> int:
    return log.read_text().count(announcement) if log.exists() else 0


def keep_logs(directory: Path) -> None:
    """Copies a test's logs where `make test` scans them for secrets after the suite."""
    kept = os.environ.get("ONCE_TEST_LOG_DIR")
    if not kept:
        return
    Path(kept).mkdir(parents=True, exist_ok=True)
    for log in directory.glob("*.log"):
        shutil.copyfile(log, Path(kept) / f"mcp-{uuid.uuid4().hex[:8]}-{log.name}")


def http(method: str, url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def psql(sql: str) -> None:
    subprocess.run(["psql", POSTGRES, "-v", "ON_ERROR_STOP=1", "-q", "-c", sql], check=True, capture_output=True)


REFUND_HTTP_SERVING = "refund-mcp serving MCP over Streamable HTTP"


class Process:
    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.args = args
        self.log = log
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(log, "ab"), stdin=subprocess.DEVNULL, env=env)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class Stack:
    """One ledger, one payment provider, and the refund MCP server, on fresh ports and a fresh
    database."""

    def __init__(self, tmp: Path, backend: str, transport: str, reconcile: bool = False, tenants: tuple[str, ...] = (),
                 env: dict | None = None, config: str | None = None, console: bool = False):
        self.tmp = tmp
        # Whether the ledger serves its web console (on a port it picks, learnt from its log).
        self.console = console
        self.console_port = 0
        # The environment of the ledger and refund-mcp processes (the OTEL_* variables).
        self.env = env
        self.reconcile = reconcile
        # The ledger's own configuration file, when a test brings one.
        self.config = config
        self.backend = backend
        self.transport = transport
        self.marker = uuid.uuid4().hex
        # Names this stack's refund-mcp processes, and nothing else, for pkill.
        self.instance = f"refund-mcp-{uuid.uuid4().hex}"
        self.processes: list[Process] = []
        if backend == "sqlite":
            self.database_url = f"sqlite://{tmp / 'ledger.db'}"
            self.pg_name = None
        else:
            self.pg_name = f"once_mcp_{self.marker}"
            psql(f"CREATE DATABASE {self.pg_name}")
            self.database_url = POSTGRES.rsplit("/", 1)[0] + "/" + self.pg_name
        # Each is learnt from its server's log when it first starts, and kept across restarts.
        self.ledger_port = 0
        self.provider_port = 0
        self.mcp_port = 0
        self.ledger: Process | None = None
        self.refund_http: Process | None = None
        # Where refund-mcp keeps the ledger's positions (--state-file); in memory when None.
        self.state_file: Path | None = None
        # Tenants and an executor key each, made with `onced` on the database before it serves:
        # the ledger then requires a key from every caller.
        self.keys = {tenant: self.create_tenant(tenant) for tenant in tenants}
        # The key that signs receipts: a SQLite ledger makes its own beside its file; replicas on
        # PostgreSQL share one made beforehand.
        self.signing_key_file = tmp / "ledger.db.signing-key"
        if backend == "postgres":
            self.signing_key_file = tmp / "signing.key"
            self.onced_command("signing-keys", "rotate", "--signing-key-file", str(self.signing_key_file))
        # The provider first: the ledger's reconciler is pointed at it.
        self.provider = self.spawn("fakepay", ["--listen", "127.0.0.1:0"])
        self.provider_port = wait_for("fakepay", lambda: served_port(self.tmp / "fakepay.log", "fakepay listening", 0))
        wait_for("fakepay", lambda: http("GET", f"{self.provider_url}/_fakepay/stats"))
        self.start_ledger()
        if transport == "http":
            self.start_refund_http()

    @property
    def provider_url(self) -> str:
        return f"http://127.0.0.1:{self.provider_port}"

    def spawn(self, binary: str, args: list[str]) -> Process:
        process = Process([str(BIN / binary), *args], self.tmp / f"{binary}.log", env=self.env)
        self.processes.append(process)
        return process

    def spawn_logged(self, args: list[str], log: Path, env: dict | None = None) -> Process:
        """A process of the test's own, stopped with the stack and its log kept."""
        process = Process(args, log, env=env or self.env)
        self.processes.append(process)
        return process

    def start_ledger(self) -> None:
        args = [
            "--database-url", self.database_url,
            "--listen", f"127.0.0.1:{self.ledger_port}",
            "--lease-sweep-interval", "100ms",
        ]
        if self.backend == "postgres":
            args += ["--signing-key-file", str(self.signing_key_file)]
        if self.reconcile:
            config = self.tmp / "onced.toml"
            config.write_text(
                "[reconciliation]\ninterval = \"100ms\"\nfirst_backoff = \"100ms\"\nmax_backoff = \"1s\"\n\n"
                "[[reconciler]]\nname = \"stripe\"\nkind = \"stripe\"\n"
                f"endpoint = \"{self.provider_url}\"\nsettle_time = \"500ms\"\n"
            )
            args += ["--config", str(config)]
        elif self.config is not None:
            config = self.tmp / "onced.toml"
            # The provider's address is known once it serves: `{provider_url}` stands for it.
            config.write_text(self.config.replace("{provider_url}", self.provider_url))
            args += ["--config", str(config)]
        if self.console:
            args += ["--console-listen", f"127.0.0.1:{self.console_port}", "--credential-ttl", "1s"]
        log = self.tmp / "onced.log"
        served = announcements(log, "onced serving")
        consoles = announcements(log, "console serving")
        self.ledger = self.spawn("onced", args)
        # Its port opens before the store is ready (a PostgreSQL database is connected to and
        # migrated first): the ledger says in its log when it serves, and where.
        self.ledger_port = wait_for("onced", lambda: served_port(log, "onced serving", served))
        if self.console:
            self.console_port = wait_for("the console", lambda: served_port(log, "console serving", consoles))

    def stop_ledger(self) -> None:
        self.ledger.stop()

    def back_up(self) -> None:
        """Copies the ledger's database (its ledger stopped), for `restore`."""
        if self.pg_name:
            psql(f"DROP DATABASE IF EXISTS {self.pg_name}_backup")
            psql(f"CREATE DATABASE {self.pg_name}_backup TEMPLATE {self.pg_name}")
            return
        backup = self.tmp / "backup"
        backup.mkdir(exist_ok=True)
        for name in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
            (backup / name).unlink(missing_ok=True)
            if (self.tmp / name).exists():
                shutil.copy(self.tmp / name, backup / name)

    def restore(self) -> None:
        """Puts the copy `back_up` made in place of the database (its ledger stopped)."""
        if self.pg_name:
            psql(f"DROP DATABASE {self.pg_name} WITH (FORCE)")
            psql(f"CREATE DATABASE {self.pg_name} TEMPLATE {self.pg_name}_backup")
            return
        for name in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
            (self.tmp / name).unlink(missing_ok=True)
            if (self.tmp / "backup" / name).exists():
                shutil.copy(self.tmp / "backup" / name, self.tmp / name)

    def create_key(self, tenant: str, name: str, roles: str) -> str:
        """A new API key of `tenant`, made with `onced keys create` on the database."""
        created = json.loads(self.onced_command(
            "keys", "create", "--tenant", tenant, "--name", name, "--role", roles, "--json",
        ))
        return created["secret"]

    def onced_command(self, *args: str) -> str:
        done = subprocess.run(
            [str(BIN / "onced"), "--database-url", self.database_url, *args],
            capture_output=True, text=True, check=True,
        )
        with open(self.tmp / "onced-commands.log", "a") as log:
            log.write(done.stderr)
        return done.stdout

    def create_tenant(self, tenant: str) -> str:
        self.onced_command("tenants", "put", tenant)
        return self.create_key(tenant, f"{tenant}-refund-mcp", "executor,reader")

    def start_tenant_refund_http(self, tenant: str | None) -> int:
        """Starts a refund-mcp over Streamable HTTP presenting `tenant`'s key (none for None);
        returns its port."""
        env = {**os.environ}
        env.pop("ONCE_LEDGER_KEY", None)
        if tenant is not None:
            env["ONCE_LEDGER_KEY"] = self.keys[tenant]
        args = [*self.refund_args(), "--http", "127.0.0.1:0"]
        args[args.index("--instance") + 1] = f"{self.instance}-{tenant}"
        log = self.tmp / f"refund-mcp-{tenant}.log"
        served = announcements(log, REFUND_HTTP_SERVING)
        process = Process([str(BIN / "refund-mcp"), *args], log, env=env)
        self.processes.append(process)
        return wait_for("refund-mcp", lambda: served_port(log, REFUND_HTTP_SERVING, served))

    @contextlib.asynccontextmanager
    async def session_at(self, port: int):
        async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session

    def refund_args(self) -> list[str]:
        return [
            "--ledger", f"http://127.0.0.1:{self.ledger_port}",
            "--provider", self.provider_url,
            "--lease-ttl", "2s",
            "--provider-timeout", "5s",
            # Lets the tests find this stack's refund-mcp processes.
            "--instance", self.instance,
            *(["--state-file", str(self.state_file)] if self.state_file else []),
        ]

    def start_refund_http(self) -> None:
        """Starts refund-mcp over Streamable HTTP: on a new port the first time, on the same
        port again after it was killed."""
        log = self.tmp / "refund-mcp.log"
        served = announcements(log, REFUND_HTTP_SERVING)
        self.refund_http = self.spawn("refund-mcp", [*self.refund_args(), "--http", f"127.0.0.1:{self.mcp_port}"])
        self.mcp_port = wait_for("refund-mcp", lambda: served_port(log, REFUND_HTTP_SERVING, served))

    def kill_refund_mcp(self) -> None:
        """SIGKILL every refund-mcp of this stack, whichever transport started it."""
        subprocess.run(["pkill", "-KILL", "-f", self.instance], check=False)
        wait_for("refund-mcp to die", lambda: subprocess.run(["pgrep", "-f", self.instance], capture_output=True).returncode == 1)

    def faults(self, **faults) -> None:
        http("POST", f"{self.provider_url}/_fakepay/faults", faults)

    def stats(self) -> dict:
        return http("GET", f"{self.provider_url}/_fakepay/stats")

    @contextlib.asynccontextmanager
    async def session(self):
        if self.transport == "stdio":
            params = StdioServerParameters(command=str(BIN / "refund-mcp"), args=self.refund_args())
            with open(self.tmp / "refund-mcp-stdio.log", "a") as errlog:
                async with stdio_client(params, errlog=errlog) as (read, write):
                    async with ClientSession(read, write) as session:
                        await session.initialize()
                        yield session
        else:
            async with streamable_http_client(f"http://127.0.0.1:{self.mcp_port}/mcp") as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    yield session

    def close(self) -> None:
        for process in self.processes:
            process.stop()
        subprocess.run(["pkill", "-KILL", "-f", self.instance], check=False)
        keep_logs(self.tmp)
        if self.pg_name:
            psql(f"DROP DATABASE IF EXISTS {self.pg_name} WITH (FORCE)")
            psql(f"DROP DATABASE IF EXISTS {self.pg_name}_backup WITH (FORCE)")


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request):
    return request.param


@pytest.fixture(params=["stdio", "http"])
def transport(request):
    return request.param


def make_stack(tmp_path, backend, transport, reconcile, tenants=(), env=None, config=None, console=False):
    for binary in ("onced", "fakepay", "refund-mcp"):
        assert (BIN / binary).exists(), f"{BIN / binary} is missing: run cargo build --workspace first"
    return Stack(tmp_path, backend, transport, reconcile, tenants, env, config, console)


@pytest.fixture
def stack(tmp_path, backend, transport):
    """Without reconcilers: UNKNOWN waits for a late report or an operator."""
    stack = make_stack(tmp_path, backend, transport, reconcile=False)
    try:
        yield stack
    finally:
        stack.close()


@pytest.fixture
def reconciled_stack(tmp_path, backend, transport):
    """With the stripe reconciler pointed at fakepay."""
    stack = make_stack(tmp_path, backend, transport, reconcile=True)
    try:
        yield stack
    finally:
        stack.close()


@pytest.fixture
def tenant_stack(tmp_path, backend):
    """Two tenants, acme and globex, each with an executor key; the ledger requires keys."""
    stack = make_stack(tmp_path, backend, "none", reconcile=False, tenants=("acme", "globex"))
    try:
        yield stack
    finally:
        stack.close()
