//! Outgoing HTTP calls as client spans: a provider's API called by a tool, a reconciler's
//! lookup. The span follows the HTTP semantic conventions and the request carries its trace
//! context, so the provider's own tracing joins the same trace.

use tracing::field::Empty;
use tracing::Instrument as _;

/// Sends `request` inside an HTTP client span.
pub async fn send(request: reqwest::RequestBuilder) -> reqwest::Result<reqwest::Response> {
    let (client, request) = request.build_split();
    let mut request = request?;
    let url = request.url();
    let span = tracing::info_span!(
        "http",
        otel.name = %request.method(),
        otel.kind = "client",
        otel.status_code = Empty,
        http.request.method = %request.method(),
        url.full = %without_credentials(url),
        server.address = url.host_str().unwrap_or_default(),
        server.port = i64::from(url.port_or_known_default().unwrap_or_default()),
        http.response.status_code = Empty,
        error.type = Empty,
    );
    {
        let _entered = span.enter();
        crate::propagation::inject_http(request.headers_mut());
    }
    let sent = client.execute(request).instrument(span.clone()).await;
    match &sent {
        Ok(response) => {
            let status = response.status();
            span.record("http.response.status_code", i64::from(status.as_u16()));
            if status.is_server_error() {
                span.record("otel.status_code", "ERROR");
                span.record("error.type", status.as_str());
            }
        }
        Err(error) => {
            span.record("otel.status_code", "ERROR");
            let kind = if error.is_timeout() {
                "timeout"
            } else if error.is_connect() {
                "connect"
            } else {
                "request"
            };
            span.record("error.type", kind);
        }
    }
    sent
}

/// A URL as a span may show it: no user name or password, and no query (lookup hints may
/// carry a customer's data there).
fn without_credentials(url: &reqwest::Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.set_query(None);
    shown.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_never_shows_credentials_or_the_query_of_a_url() {
        let url =
            reqwest::Url::parse("https://sk_live:secret@api.example/v1/refunds?email=a@b").unwrap();
        assert_eq!(without_credentials(&url), "https://api.example/v1/refunds");
    }
}
