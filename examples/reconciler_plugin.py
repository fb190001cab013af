"""An out-of-process reconciler, in Python, speaking once.reconciler.v1.

It stands for a provider whose records are keyed by the idempotency key the executor sent
(the operation's provider key). Here the "provider" is a JSON file mapping provider keys to
records, read on every lookup; a real plugin calls the provider's API instead.

    python examples/reconciler_plugin.py --port 7070 --records records.json

and in onced's --config file:

    [[reconciler]]
    name = "bank"
    kind = "grpc"
    endpoint = "http://127.0.0.1:7070"
"""

import argparse
import json
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parents[1] / "proto"


def load_stubs():
    """Generates the Python stubs for the plugin protocol from the repository's proto file."""
    out = Path(tempfile.mkdtemp(prefix="once-reconciler-stubs-"))
    include = Path(protoc.__file__).parent / "_proto"
    status = protoc.main([
        "protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}",
        "once/reconciler/v1/reconciler.proto",
    ])
    if status != 0:
        raise SystemExit("could not compile the plugin protocol")
    sys.path.insert(0, str(out))
    from once.reconciler.v1 import reconciler_pb2, reconciler_pb2_grpc  # noqa: E402
    return reconciler_pb2, reconciler_pb2_grpc


pb, rpc = load_stubs()


class BankReconciler(rpc.ReconcilerServicer):
    def __init__(self, records: Path):
        self.records = records

    def Capabilities(self, request, context):
        # The bank's record of a key is complete and immediate, and it deduplicates by key.
        response = pb.CapabilitiesResponse(miss_is_authoritative=True, dedupes_by_provider_key=True)
        response.settle_time.FromMilliseconds(0)
        return response

    def Lookup(self, request, context):
        try:
            records = json.loads(self.records.read_text())
        except (OSError, ValueError) as error:
            # Could not read the provider: that is never a miss.
            return pb.LookupResponse(unknown=pb.Undetermined(why=f"provider unreadable: {type(error).__name__}"))
        record = records.get(request.provider_key)
        if record is None:
            evidence = json.dumps({"searched": "provider_key", "found": 0})
            return pb.LookupResponse(absent=pb.Absent(evidence_json=evidence))
        return pb.LookupResponse(confirmed=pb.Confirmed(
            provider_ref=record["id"],
            result=json.dumps(record).encode(),
            evidence_json=json.dumps({"record": record["id"]}),
        ))


def serve(port: int, records: Path) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rpc.add_ReconcilerServicer_to_server(BankReconciler(records), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=7070)
    parser.add_argument("--records", type=Path, required=True)
    args = parser.parse_args()
    serve(args.port, args.records).wait_for_termination()
