//! Who may use the proxy's HTTP listener: the `Host` and `Origin` it answers to, and the
//! credential a client presents. A request the door refuses is answered before its body is
//! read, before anything is forwarded and before the ledger is asked anything.
//!
//! `Host` and `Origin` are what a browser page cannot forge: a page on another site reaching a
//! listener on this machine (DNS rebinding) sends its own host name and origin. The defaults
//! are the listen address's loopback names (`localhost`, `127.0.0.1`, `[::1]`, and the
//! address itself when it is a specific one), each with the port.

use std::net::SocketAddr;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, Response, StatusCode, Uri};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The shortest client token accepted.
pub const MIN_TOKEN: usize = 16;

/// The listener's admission rules.
#[derive(Clone)]
pub struct Door {
    /// `host[:port]` values accepted in `Host`, lower-cased.
    hosts: Vec<String>,
    /// Origins accepted when a request carries one, lower-cased.
    origins: Vec<String>,
    /// SHA-256 of the bearer token clients present, when the listener asks for one.
    token: Option<[u8; 32]>,
    tls: bool,
}

impl std::fmt::Debug for Door {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Door")
            .field("hosts", &self.hosts)
            .field("origins", &self.origins)
            .field("token", &self.token.map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .finish()
    }
}

impl Door {
    /// The door of a listener bound to `listening`: its loopback names and `allowed_hosts`
    /// in `Host`, their origins and `allowed_origins` in `Origin`, and `token` (when given) as
    /// the bearer credential.
    pub fn new(
        listening: SocketAddr,
        tls: bool,
        allowed_hosts: &[String],
        allowed_origins: &[String],
        token: Option<&str>,
    ) -> Self {
        let port = listening.port();
        let mut names = vec!["localhost".to_owned(), "127.0.0.1".into(), "[::1]".into()];
        let ip = listening.ip();
        if !ip.is_unspecified() && !ip.is_loopback() {
            names.push(match ip {
                std::net::IpAddr::V4(v4) => v4.to_string(),
                std::net::IpAddr::V6(v6) => format!("[{v6}]"),
            });
        }
        let scheme = if tls { "https" } else { "http" };
        let default_port = if tls { 443 } else { 80 };
        let mut hosts: Vec<String> = names.iter().map(|n| format!("{n}:{port}")).collect();
        if port == default_port {
            hosts.extend(names.iter().cloned());
        }
        let mut origins: Vec<String> = hosts.iter().map(|h| format!("{scheme}://{h}")).collect();
        hosts.extend(allowed_hosts.iter().map(|h| h.to_ascii_lowercase()));
        origins.extend(
            allowed_origins
                .iter()
                .map(|o| o.trim_end_matches('/').to_ascii_lowercase()),
        );
        Self {
            hosts,
            origins,
            token: token.map(|t| Sha256::digest(t.as_bytes()).into()),
            tls,
        }
    }

    /// Whether the listener is served over TLS.
    pub fn tls(&self) -> bool {
        self.tls
    }

    /// Whether the client's `Authorization` header is the proxy's credential (and so never
    /// crosses to the upstream).
    pub fn takes_authorization(&self) -> bool {
        self.token.is_some()
    }

    /// Admits a request, or answers it: 421 for a `Host` not allowed, 403 for an `Origin` not
    /// allowed, 401 without the credential.
    pub fn admit(&self, headers: &HeaderMap, uri: &Uri) -> Result<(), Box<Response<Body>>> {
        // HTTP/2 names the host in `:authority`, HTTP/1.1 in `Host`; a request naming two
        // hosts names none.
        let named = headers
            .get(header::HOST)
            .map(|h| h.to_str().unwrap_or("<not text>").to_ascii_lowercase());
        let authority = uri.authority().map(|a| a.as_str().to_ascii_lowercase());
        let host = match (named, authority) {
            (Some(named), Some(authority)) if named != authority => {
                return Err(Box::new(refused(
                    StatusCode::MISDIRECTED_REQUEST,
                    "the request names two hosts (Host and :authority)",
                )))
            }
            (Some(host), _) | (None, Some(host)) => host,
            (None, None) => String::new(),
        };
        if !self.hosts.contains(&host) {
            return Err(Box::new(refused(
                StatusCode::MISDIRECTED_REQUEST,
                &format!("the Host {host:?} is not one this proxy answers to (--allowed-host)"),
            )));
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin.to_str().unwrap_or_default().to_ascii_lowercase();
            if !self.origins.contains(&origin) {
                return Err(Box::new(refused(
                    StatusCode::FORBIDDEN,
                    &format!("the Origin {origin:?} is not allowed (--allowed-origin)"),
                )));
            }
        }
        if let Some(expected) = &self.token {
            let presented = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split_once(' '))
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, token)| token)
                .map(|t| <[u8; 32]>::from(Sha256::digest(t.trim().as_bytes())));
            let admitted = presented.is_some_and(|p| bool::from(p.ct_eq(expected)));
            if !admitted {
                let mut response = refused(
                    StatusCode::UNAUTHORIZED,
                    "present the proxy's client token as Authorization: Bearer <token>",
                );
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return Err(Box::new(response));
            }
        }
        Ok(())
    }
}

fn refused(code: StatusCode, why: &str) -> Response<Body> {
    let mut response = Response::new(Body::from(format!("once-proxy: {why}\n")));
    *response.status_mut() = code;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(host: &str, origin: Option<&str>, bearer: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, host.parse().unwrap());
        if let Some(origin) = origin {
            headers.insert(header::ORIGIN, origin.parse().unwrap());
        }
        if let Some(bearer) = bearer {
            headers.insert(
                header::AUTHORIZATION,
                format!("Bearer {bearer}").parse().unwrap(),
            );
        }
        headers
    }

    fn status(door: &Door, headers: HeaderMap) -> u16 {
        match door.admit(&headers, &Uri::from_static("/mcp")) {
            Ok(()) => 200,
            Err(response) => response.status().as_u16(),
        }
    }

    #[test]
    fn the_loopback_names_and_their_origins_are_let_in_by_default() {
        let door = Door::new("127.0.0.1:8808".parse().unwrap(), false, &[], &[], None);
        for host in [
            "127.0.0.1:8808",
            "localhost:8808",
            "LOCALHOST:8808",
            "[::1]:8808",
        ] {
            assert_eq!(status(&door, request(host, None, None)), 200, "{host}");
        }
        assert_eq!(
            status(
                &door,
                request("localhost:8808", Some("http://localhost:8808"), None)
            ),
            200
        );
        // A page reaching the listener through a rebound name, or from another origin.
        assert_eq!(status(&door, request("evil.example:8808", None, None)), 421);
        assert_eq!(status(&door, request("localhost:9999", None, None)), 421);
        assert_eq!(status(&door, request("localhost", None, None)), 421);
        assert_eq!(
            status(
                &door,
                request("localhost:8808", Some("http://evil.example"), None)
            ),
            403
        );
        assert_eq!(
            status(&door, request("localhost:8808", Some("null"), None)),
            403
        );
        assert_eq!(
            status(
                &door,
                request("localhost:8808", Some("https://localhost:8808"), None)
            ),
            403
        );
    }

    #[test]
    fn allowed_names_add_to_the_defaults() {
        let door = Door::new(
            "0.0.0.0:443".parse().unwrap(),
            true,
            &["mcp.example.com".into()],
            &["https://app.example.com/".into()],
            Some("a-long-enough-client-token"),
        );
        let token = Some("a-long-enough-client-token");
        assert_eq!(
            status(
                &door,
                request("mcp.example.com", Some("https://app.example.com"), token)
            ),
            200
        );
        assert_eq!(
            status(
                &door,
                request("localhost", Some("https://localhost"), token)
            ),
            200
        );
        assert_eq!(status(&door, request("0.0.0.0:443", None, token)), 421);
    }

    #[test]
    fn a_listener_with_a_token_asks_every_request_for_it() {
        let door = Door::new(
            "127.0.0.1:1".parse().unwrap(),
            false,
            &[],
            &[],
            Some("s3cret-client-token"),
        );
        assert!(door.takes_authorization());
        assert_eq!(
            status(
                &door,
                request("localhost:1", None, Some("s3cret-client-token"))
            ),
            200
        );
        assert_eq!(
            status(
                &door,
                request("localhost:1", None, Some("s3cret-client-tokeN"))
            ),
            401
        );
        assert_eq!(status(&door, request("localhost:1", None, None)), 401);
        let mut lower = request("localhost:1", None, None);
        lower.insert(
            header::AUTHORIZATION,
            "bearer s3cret-client-token".parse().unwrap(),
        );
        assert_eq!(status(&door, lower), 200);
        // The Host is judged first: a refused name learns nothing of the credential.
        assert_eq!(status(&door, request("evil:1", None, None)), 421);
        assert!(!format!("{door:?}").contains("s3cret"));
    }
}
