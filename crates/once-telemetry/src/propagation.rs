//! The W3C trace context (`traceparent`, `tracestate`) in and out of the carriers a call
//! crosses: gRPC metadata (client → `onced`), HTTP headers (→ a provider), and an MCP
//! request's `_meta` (an MCP client → the tool).
//!
//! Injecting sends the context of the current `tracing` span when it belongs to an
//! OpenTelemetry trace; continuing makes a span the child of the context a carrier holds. They
//! work under any `tracing-opentelemetry` layer (not only [`crate::Telemetry`]'s), and do
//! nothing without one.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The keys of the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

/// Puts the current span's trace context into `carrier` (a key and value each).
pub fn inject(mut put: impl FnMut(&'static str, String)) {
    let span = tracing::Span::current();
    if span.is_none() {
        return;
    }
    let context = span.context();
    if !context.span().span_context().is_valid() {
        return;
    }
    struct Put<'a, F>(&'a mut F);
    impl<F: FnMut(&'static str, String)> Injector for Put<'_, F> {
        fn set(&mut self, key: &str, value: String) {
            match key {
                TRACEPARENT => (self.0)(TRACEPARENT, value),
                TRACESTATE => (self.0)(TRACESTATE, value),
                _ => {}
            }
        }
    }
    TraceContextPropagator::new().inject_context(&context, &mut Put(&mut put));
}

/// Puts the current span's trace context into gRPC metadata.
pub fn inject_grpc(metadata: &mut tonic::metadata::MetadataMap) {
    inject(|key, value| {
        if let Ok(value) = value.parse() {
            metadata.insert(key, value);
        }
    });
}

/// Puts the current span's trace context into HTTP headers.
pub fn inject_http(headers: &mut http::HeaderMap) {
    inject(|key, value| {
        if let Ok(value) = http::HeaderValue::from_str(&value) {
            headers.insert(key, value);
        }
    });
}

/// Makes `span` the child of the trace context `get` finds under [`TRACEPARENT`] and
/// [`TRACESTATE`], if it finds a valid one.
pub fn continue_trace(span: &tracing::Span, get: impl Fn(&str) -> Option<String>) {
    if span.is_disabled() {
        return;
    }
    /// The traceparent and tracestate found.
    struct Found(String, Option<String>);
    impl Extractor for Found {
        fn get(&self, key: &str) -> Option<&str> {
            match key {
                TRACEPARENT => Some(&self.0),
                TRACESTATE => self.1.as_deref(),
                _ => None,
            }
        }
        fn keys(&self) -> Vec<&str> {
            vec![TRACEPARENT, TRACESTATE]
        }
    }
    let Some(parent) = get(TRACEPARENT) else {
        return;
    };
    let found = Found(parent, get(TRACESTATE));
    let context = TraceContextPropagator::new().extract(&found);
    if context.span().span_context().is_valid() {
        let _ = span.set_parent(context);
    }
}

/// [`continue_trace`] from HTTP headers (or gRPC metadata, which arrives as HTTP/2 headers).
pub fn continue_from_headers(span: &tracing::Span, headers: &http::HeaderMap) {
    continue_trace(span, |key| {
        headers
            .get(key)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
}
