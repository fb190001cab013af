"""A reconciler written in Python with grpcio, speaking once.reconciler.v1 to a real onced."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from grpc_tools import protoc

from conftest import BIN, ROOT, free_port, served_port, wait_for

sys.path.insert(0, str(ROOT / "examples"))
import reconciler_plugin  # noqa: E402  (the example plugin, as a plugin author would write it)


@pytest.fixture(scope="module")
def ledger_stubs():
    out = Path(tempfile.mkdtemp(prefix="once-ledger-stubs-"))
    include = Path(protoc.__file__).parent / "_proto"
    assert protoc.main([
        "protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}",
        "once/ledger/v1/ledger.proto",
    ]) == 0
    sys.path.insert(0, str(out))
    from once.ledger.v1 import ledger_pb2, ledger_pb2_grpc
    return ledger_pb2, ledger_pb2_grpc


def test_a_python_plugin_settles_operations(tmp_path, ledger_stubs):
    pb, rpc = ledger_stubs
    records = tmp_path / "records.json"
    records.write_text("{}")
    plugin_port = free_port()
    plugin = reconciler_plugin.serve(plugin_port, records)
    config = tmp_path / "onced.toml"
    config.write_text(
        '[reconciliation]\ninterval = "100ms"\nfirst_backoff = "100ms"\n\n'
        f'[[reconciler]]\nname = "bank"\nkind = "grpc"\nendpoint = "http://127.0.0.1:{plugin_port}"\n'
    )
    onced = subprocess.Popen(
        [str(BIN / "onced"), "--database-url", f"sqlite://{tmp_path / 'ledger.db'}",
         "--listen", "127.0.0.1:0", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "onced.log", "wb"),
    )
    try:
        ledger_port = wait_for("onced", lambda: served_port(tmp_path / "onced.log", "onced serving", 0))
        ledger = rpc.LedgerStub(grpc.insecure_channel(f"127.0.0.1:{ledger_port}"))

        def begin(operation_id: str):
            # A short lease: a miss proves nothing until the settle time has passed after it.
            lease = duration_pb2.Duration(nanos=300_000_000)
            return ledger.Begin(pb.BeginRequest(
                tool="transfer", operation_id=operation_id, arguments_json=json.dumps({"to": operation_id}),
                attempt_id=str(uuid.uuid4()), provider="bank", lookup_hints_json="{}", lease_ttl=lease,
            ))

        landed = begin("transfer:landed")
        lost = begin("transfer:lost")
        # The bank holds the first transfer under its provider key, not the second.
        records.write_text(json.dumps({landed.execute.provider_key: {"id": "tr_1", "amount": 5}}))
        for grant in (landed, lost):
            ledger.ReportUnknown(pb.ReportUnknownRequest(
                operation_id=grant.operation_id, fencing_token=grant.execute.fencing_token, reason="timeout"))

        def state(operation_id: str):
            return ledger.GetOperation(pb.GetOperationRequest(operation_id=operation_id)).operation

        wait_for("the landed transfer confirmed", lambda: state("transfer:landed").state == pb.OPERATION_STATE_CONFIRMED)
        wait_for("the lost transfer absent", lambda: state("transfer:lost").state == pb.OPERATION_STATE_ABSENT)
        confirmed = state("transfer:landed")
        assert confirmed.provider_ref == "tr_1"
        assert json.loads(confirmed.result) == {"id": "tr_1", "amount": 5}
        events = ledger.GetOperation(pb.GetOperationRequest(operation_id="transfer:landed")).events
        assert [e.actor for e in events if e.kind == "RECONCILED"] == ["reconciler:bank"]
    finally:
        onced.terminate()
        onced.wait(timeout=10)
        plugin.stop(grace=None)
