"""The README's five minutes, as a newcomer runs them: its commands, in its order, through the
built binaries, and the demo's output against what the README shows. It fails when either
drifts. Only the addresses change: every process listens on a port of its own (the README's
fixed ones may be taken on a shared machine), and the ledger's database is the test's."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from conftest import BIN, ROOT, Process, served_port, wait_for

README = (ROOT / "README.md").read_text()


def walkthrough() -> str:
    start = README.index("## Five minutes")
    return README[start:README.index("\n## ", start + 1)]


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of `text`: (language, body)."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S)]


def commands(block: str) -> list[list[str]]:
    """The commands of a shell block, comments and continuations taken out."""
    joined = block.replace("\\\n", " ")
    return [shlex.split(line.split("  #")[0]) for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def binary(command: list[str]) -> tuple[str, list[str]]:
    """`cargo run [--release] -p NAME [-- ARGS…]` as the built binary NAME and its ARGS."""
    assert command[:2] == ["cargo", "run"], command
    rest = command[2:]
    name = rest[rest.index("-p") + 1]
    args = rest[rest.index("--") + 1:] if "--" in rest else []
    return name, args


def pattern(line: str) -> re.Pattern:
    """A line the README shows: `…` stands for whatever the run printed there."""
    return re.compile("^" + ".*?".join(re.escape(part) for part in line.split("…")) + "$")


class Gate:
    """The reconciler's way to fakepay, shut until the walkthrough has shown the refund UNKNOWN
    (step 5): meanwhile every lookup is answered 503, which tells the reconciler nothing, so the
    refund stays UNKNOWN however slowly this machine runs steps 3 to 5. Then it forwards."""

    def __init__(self, upstream: str):
        self.opened = threading.Event()
        gate = self

        class Forward(BaseHTTPRequestHandler):
            def do_GET(self):
                gate.forward(self, upstream)

            def do_POST(self):
                gate.forward(self, upstream)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def forward(self, handler: BaseHTTPRequestHandler, upstream: str) -> None:
        if not self.opened.is_set():
            status, body, kind = 503, b'{"error":{"message":"not yet"}}', "application/json"
        else:
            length = int(handler.headers.get("Content-Length") or 0)
            request = urllib.request.Request(
                upstream + handler.path, data=handler.rfile.read(length) if length else None,
                method=handler.command,
                headers={k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection")})
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    status, body, kind = answer.status, answer.read(), answer.headers.get("Content-Type", "")
            except urllib.error.HTTPError as answer:
                status, body, kind = answer.code, answer.read(), answer.headers.get("Content-Type", "")
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def kill(self) -> None:
        self.server.shutdown()


def test_the_readme_walkthrough_runs_as_written(tmp_path):
    section = walkthrough()
    found = blocks(section)
    servers = next(body for lang, body in found if lang == "sh" and "-p refund-mcp" in body)
    started = commands(servers)
    assert [binary(c)[0] for c in started] == ["onced", "fakepay", "refund-mcp"], started
    # One build profile for all, so nothing compiles twice.
    assert all("--release" in c for c in started), started
    assert "make demo-up" in section and "demo-up:" in (ROOT / "Makefile").read_text()

    env = {**os.environ, "NO_COLOR": "1"}
    processes = []
    try:
        onced_args = binary(started[0])[1]
        fakepay_log, onced_log, mcp_log = tmp_path / "fakepay.log", tmp_path / "onced.log", tmp_path / "mcp.log"
        fakepay = Process([str(BIN / "fakepay"), *binary(started[1])[1]], fakepay_log,
                          env={**env, "FAKEPAY_LISTEN": "127.0.0.1:0"})
        processes.append(fakepay)
        provider_port = wait_for("fakepay", lambda: served_port(fakepay_log, "fakepay listening", 0))
        provider = f"http://127.0.0.1:{provider_port}"
        # The README's reconciler configuration, pointed at this run's fakepay through a gate
        # that keeps lookups out until step 5 has shown the refund UNKNOWN: a person running the
        # walkthrough sees it UNKNOWN for a second or so, and a loaded machine may take longer.
        config = onced_args[onced_args.index("--config") + 1]
        text = (ROOT / config).read_text()
        assert "http://127.0.0.1:12111" in text
        gate = Gate(provider)
        processes.append(gate)
        ours = tmp_path / "onced.toml"
        ours.write_text(text.replace("http://127.0.0.1:12111", gate.url))
        onced_args[onced_args.index("--config") + 1] = str(ours)
        onced = Process([str(BIN / "onced"), *onced_args], onced_log,
                        env={**env, "ONCE_LISTEN": "127.0.0.1:0",
                             "ONCE_DATABASE_URL": f"sqlite://{tmp_path / 'once.db'}"})
        processes.append(onced)
        ledger_port = wait_for("onced", lambda: served_port(onced_log, "onced serving", 0))
        ledger = f"http://127.0.0.1:{ledger_port}"
        mcp_args = [a.replace("127.0.0.1:8000", "127.0.0.1:0") for a in binary(started[2])[1]]
        mcp = Process([str(BIN / "refund-mcp"), *mcp_args], mcp_log,
                      env={**env, "REFUND_MCP_LEDGER": ledger, "REFUND_MCP_PROVIDER": provider})
        processes.append(mcp)
        mcp_port = wait_for("refund-mcp", lambda: served_port(mcp_log, "refund-mcp serving MCP", 0))

        # `make demo`, as the Makefile runs it, twice: a run can be made again.
        assert "make demo\n" in section
        shown = next(body for lang, body in found if lang == "" and body.startswith("1. issue_refund"))
        expected = shown.rstrip("\n").splitlines()
        for run in (1, 2):
            gate.opened.clear()
            stderr = tmp_path / f"demo-{run}.err"
            with open(stderr, "w") as errors:
                demo = subprocess.Popen(
                    [sys.executable, str(ROOT / "examples" / "refund_demo.py"),
                     "--mcp", f"http://127.0.0.1:{mcp_port}/mcp", "--provider", provider],
                    stdout=subprocess.PIPE, stderr=errors, text=True, env={**env, "PYTHONUNBUFFERED": "1"})
                lines, shown_unknown = [], False
                for line in demo.stdout:
                    lines.append(line)
                    shown_unknown = shown_unknown or line.startswith("5. ")
                    if shown_unknown and line.startswith("   refunds at the provider"):
                        gate.opened.set()
                assert demo.wait(timeout=120) == 0, stderr.read_text()
            printed = "".join(lines).strip("\n").splitlines()
            assert len(printed) == len(expected), f"run {run}:\n{''.join(lines)}"
            for want, got in zip(expected, printed):
                assert pattern(want).match(got), f"run {run}: README shows\n  {want}\nthe run printed\n  {got}"
            assert "Session termination failed" not in stderr.read_text(), stderr.read_text()

        # The operator's commands that name no operation of the README's.
        operator = next(body for lang, body in found if lang == "sh" and "-p oncectl" in body)
        for command in commands(operator):
            name, args = binary(command)
            assert name == "oncectl", command
            if args[0] in ("status", "list"):
                ran = subprocess.run([str(BIN / "oncectl"), "--addr", ledger, *args],
                                     capture_output=True, text=True, timeout=60, env=env)
                assert ran.returncode == 0, (command, ran.stderr)
    finally:
        for process in processes:
            process.kill()
