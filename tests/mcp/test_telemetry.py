"""One refund, driven by the official MCP SDK with a W3C trace context in `_meta`, is one trace:
the tool call in refund-mcp, the ledger's Begin and Confirm in onced with their database
transactions, and the POST to the provider. The spans and onced's metrics are received over
OTLP/gRPC by a collector built here from the opentelemetry-proto definitions."""

from __future__ import annotations

import json
import os
import secrets
import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from conftest import make_stack, wait_for

pytestmark = pytest.mark.anyio

SERVER = trace_pb2.Span.SpanKind.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SpanKind.SPAN_KIND_CLIENT


def value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Collector:
    """Keeps every span and the name of every metric it is sent."""

    def __init__(self):
        self.lock = threading.Lock()
        self.spans: list[dict] = []
        self.metrics: set[str] = set()

    def export(self, request):
        with self.lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                for resource in request.resource_spans:
                    service = {a.key: value(a.value) for a in resource.resource.attributes}.get("service.name")
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            self.spans.append({
                                "service": service,
                                "name": span.name,
                                "kind": span.kind,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "attributes": {a.key: value(a.value) for a in span.attributes},
                            })
                return trace_service_pb2.ExportTraceServiceResponse()
            for resource in request.resource_metrics:
                for scope in resource.scope_metrics:
                    self.metrics.update(metric.name for metric in scope.metrics)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [span for span in self.spans if span["trace_id"] == trace_id]


class Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: Collector):
        self.collector = collector

    def Export(self, request, context):  # noqa: N802
        return self.collector.export(request)


class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, collector: Collector):
        self.collector = collector

    def Export(self, request, context):  # noqa: N802
        return self.collector.export(request)


@pytest.fixture
def collector():
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(collector), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(collector), server)
    collector.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector
    finally:
        server.stop(grace=None)


def one(spans: list[dict], **wanted) -> dict:
    found = [s for s in spans if all(s[k] == v for k, v in wanted.items())]
    assert len(found) == 1, f"expected one span {wanted}, found {len(found)} among {[s['name'] for s in spans]}"
    return found[0]


async def test_one_refund_is_one_trace_from_the_mcp_client_to_the_provider(tmp_path, backend, collector):
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
    }
    stack = make_stack(tmp_path, backend, "http", reconcile=False, env=env)
    try:
        trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
        async with stack.session() as session:
            result = await session.call_tool(
                "issue_refund", {"order_id": "order_7", "amount_cents": 500, "currency": "eur"},
                meta={"traceparent": f"00-{trace_id}-{caller}-01"},
            )
        assert not result.is_error, result.content[0].text
        operation_id = json.loads(result.content[0].text)["operation_id"]

        def complete():
            spans = collector.trace(trace_id)
            names = {s["name"] for s in spans}
            wanted = {"tools/call issue_refund", "once.ledger.v1.Ledger/Begin", "once.ledger.v1.Ledger/Confirm", "POST"}
            return spans if wanted <= names and any(n.startswith("report ") for n in names) else None

        spans = wait_for("the refund's spans", complete, limit=30)
        ids = {s["span_id"] for s in spans}
        # Connected: the tool call is the child of the caller's span, everything else of a
        # span in the trace.
        tool = one(spans, name="tools/call issue_refund")
        assert tool["parent"] == caller and tool["service"] == "refund-mcp" and tool["kind"] == SERVER
        for span in spans:
            assert span is tool or span["parent"] in ids, f"{span['name']} hangs off no span of the trace"
        assert tool["attributes"]["mcp.method.name"] == "tools/call"
        assert tool["attributes"]["gen_ai.tool.name"] == "issue_refund"
        assert tool["attributes"]["mcp.session.id"], "Streamable HTTP has a session"
        assert tool["attributes"]["once.operation_id"] == operation_id
        assert tool["attributes"]["once.outcome"] == "EXECUTED"

        begin = one(spans, name="once.ledger.v1.Ledger/Begin")
        assert begin["service"] == "onced" and begin["kind"] == SERVER
        assert begin["parent"] in {s["span_id"] for s in spans if s["service"] == "refund-mcp"}
        attributes = begin["attributes"]
        assert (attributes["rpc.system"], attributes["rpc.service"], attributes["rpc.method"]) == (
            "grpc", "once.ledger.v1.Ledger", "Begin")
        assert attributes["rpc.grpc.status_code"] == 0
        assert attributes["once.operation_id"] == operation_id
        assert attributes["once.decision"] == "EXECUTE"
        assert attributes["once.attempt"] == 1
        assert attributes["once.tool"] == "issue_refund"

        system = "postgresql" if backend == "postgres" else "sqlite"
        transaction = one(spans, name=f"begin {system}")
        assert transaction["parent"] == begin["span_id"] and transaction["kind"] == CLIENT
        assert transaction["attributes"]["db.system.name"] == system

        post = one(spans, name="POST")
        assert post["service"] == "refund-mcp" and post["kind"] == CLIENT
        assert post["attributes"]["http.request.method"] == "POST"
        assert post["attributes"]["http.response.status_code"] == 200
        assert post["attributes"]["url.full"] == f"{stack.provider_url}/v1/refunds"

        confirm = one(spans, name="once.ledger.v1.Ledger/Confirm")
        assert confirm["attributes"]["rpc.grpc.status_code"] == 0
        assert confirm["attributes"]["once.operation_id"] == operation_id
        report = one(spans, name=f"report {system}")
        assert report["parent"] == confirm["span_id"]

        # onced pushes its metrics over OTLP too.
        wait_for("onced's metrics", lambda: {"once.decisions", "rpc.server.call.duration"} <= collector.metrics)
    finally:
        stack.close()
