"""What the demo's and the proxy's processes say when they cannot listen: one line naming the
address, exit status 1, never a backtrace (even with RUST_BACKTRACE=1)."""

import os
import socket
import subprocess

from conftest import BIN


def test_an_address_in_use_is_named_by_every_process(tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text('[tools.place_order]\nintent = ["order", "{/order_id}"]\n')
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        commands = {
            "fakepay": [str(BIN / "fakepay"), "--listen", address],
            "refund-mcp": [str(BIN / "refund-mcp"), "--http", address],
            "once-proxy": [str(BIN / "once-proxy"), "--policy", str(policy), "--listen", address,
                           "--upstream", "http://127.0.0.1:9/mcp"],
        }
        env = {**os.environ, "RUST_BACKTRACE": "1"}
        for name, command in commands.items():
            ran = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env,
                                 stdin=subprocess.DEVNULL)
            said = ran.stderr
            assert ran.returncode == 1, f"{name}: {said}"
            lines = [line for line in said.splitlines() if address in line and "in use" in line]
            assert len(lines) == 1, f"{name} names {address} once: {said}"
            assert "backtrace" not in said.lower() and "panicked" not in said, f"{name}: {said}"
