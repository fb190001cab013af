//! A Stripe-shaped refunds API with fault injection.
//!
//! - `POST /v1/refunds` (form or JSON: `payment_intent`, `amount`, `currency`, `metadata`),
//!   honouring `Idempotency-Key` as Stripe does: the same key and parameters replay the first
//!   response for 24 hours, the same key with other parameters is an error, and a request that
//!   arrives while the first is still executing gets a 409.
//! - `GET /v1/refunds/{id}` and `GET /v1/refunds` (Stripe's list shape: `object`, `data`,
//!   `has_more`; `payment_intent`, `limit`, `starting_after`), newest first.
//! - Faults, for every request (`POST /_fakepay/faults`) or one request (the
//!   `X-Fakepay-Fault` header): a delay, failing before the commit (500, nothing stored),
//!   committing and then dropping the connection without a response, committing and then
//!   answering 500, committing and then stalling, lookups unavailable (503), and list results
//!   lagging behind writes.
//! - `GET /_fakepay/stats` counts effects, so tests can assert "exactly one refund".

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// How long an idempotency key is remembered.
const IDEMPOTENCY_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// What can go wrong with a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum WriteFault {
    #[default]
    None,
    /// Answer 500 before anything is stored.
    FailBeforeCommit,
    /// Store the refund, then drop the connection without a response.
    CommitThenDrop,
    /// Store the refund, then answer 500.
    #[serde(rename = "commit_then_500")]
    CommitThen500,
    /// Store the refund, then wait a minute before answering: a window in which the caller can
    /// crash after the effect and before its report.
    CommitThenStall,
}

/// The faults in force for every request until changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct Faults {
    pub write: WriteFault,
    /// How many writes the write fault applies to; every write when absent.
    pub write_times: Option<u32>,
    /// Added before every answer.
    pub delay_ms: u64,
    /// Lookups (GET) answer 503.
    pub lookups_unavailable: bool,
    /// Lists leave out refunds younger than this.
    pub list_lag_ms: u64,
}

/// Effect counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Stats {
    /// Refunds that exist: the effects.
    pub refunds: usize,
    /// Refund creation requests received.
    pub refund_requests: usize,
    /// Lookups received (GET by id and lists).
    pub lookups: usize,
}

#[derive(Debug, Clone)]
struct Refund {
    body: Value,
    created: SystemTime,
}

#[derive(Debug, Clone)]
enum Remembered {
    /// The first request with this key is still executing.
    Executing,
    Done {
        parameters: String,
        status: StatusCode,
        body: Value,
        at: SystemTime,
    },
}

#[derive(Debug, Default)]
struct Inner {
    refunds: Vec<Refund>,
    keys: HashMap<String, Remembered>,
    faults: Faults,
    stats: Stats,
}

/// The provider's state. Cheap to clone; clones share it.
#[derive(Debug, Clone, Default)]
pub struct Provider {
    inner: Arc<Mutex<Inner>>,
}

impl Provider {
    pub fn set_faults(&self, faults: Faults) {
        self.inner.lock().unwrap().faults = faults;
    }

    pub fn stats(&self) -> Stats {
        self.inner.lock().unwrap().stats.clone()
    }
}

/// The HTTP API over `provider`.
pub fn router(provider: Provider) -> Router {
    Router::new()
        .route("/v1/refunds", post(create_refund).get(list_refunds))
        .route("/v1/refunds/{id}", get(get_refund))
        .route("/_fakepay/faults", post(set_faults).get(get_faults))
        .route("/_fakepay/stats", get(stats))
        .with_state(provider)
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        Json(json!({ "error": { "type": kind, "message": message } })),
    )
        .into_response()
}

fn now_secs(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// The refund parameters, from a form (Stripe's `metadata[key]=value`) or a JSON body.
fn parameters(headers: &HeaderMap, body: &Bytes) -> Result<Map<String, Value>, String> {
    let is_json = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(map)) => Ok(map),
            _ => Err("the body must be a JSON object".into()),
        };
    }
    let mut map = Map::new();
    let mut metadata = Map::new();
    for (key, value) in form_urlencoded::parse(body) {
        if let Some(inner) = key
            .strip_prefix("metadata[")
            .and_then(|k| k.strip_suffix(']'))
        {
            metadata.insert(inner.to_owned(), Value::String(value.into_owned()));
        } else if key == "amount" {
            let amount = value
                .parse::<i64>()
                .map_err(|_| "amount must be an integer".to_owned())?;
            map.insert(key.into_owned(), json!(amount));
        } else {
            map.insert(key.into_owned(), Value::String(value.into_owned()));
        }
    }
    if !metadata.is_empty() {
        map.insert("metadata".into(), Value::Object(metadata));
    }
    Ok(map)
}

fn validate(params: &Map<String, Value>) -> Result<(), String> {
    let payment_intent = params
        .get("payment_intent")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if payment_intent.is_empty() {
        return Err("payment_intent is required".into());
    }
    let amount = params.get("amount").and_then(Value::as_i64).unwrap_or(0);
    if amount <= 0 {
        return Err("amount must be a positive integer".into());
    }
    let currency = params
        .get("currency")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if currency.len() != 3 || !currency.chars().all(|c| c.is_ascii_alphabetic()) {
        return Err("currency must be a three-letter code".into());
    }
    Ok(())
}

/// Drops the connection without a response: unwinding out of the handler ends the
/// connection's task. `resume_unwind` skips the panic hook, so nothing is printed.
fn drop_connection() -> ! {
    std::panic::resume_unwind(Box::new("fakepay: dropping the connection after commit"))
}

async fn create_refund(
    State(provider): State<Provider>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let per_request = headers
        .get("x-fakepay-fault")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| serde_json::from_value::<WriteFault>(Value::String(v.to_owned())).ok());
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let (fault, delay) = {
        let mut inner = provider.inner.lock().unwrap();
        inner.stats.refund_requests += 1;
        let mut fault = inner.faults.write;
        if fault != WriteFault::None {
            match &mut inner.faults.write_times {
                Some(0) => fault = WriteFault::None,
                Some(n) => *n -= 1,
                None => {}
            }
        }
        (
            per_request.unwrap_or(fault),
            Duration::from_millis(inner.faults.delay_ms),
        )
    };
    let params = match parameters(&headers, &body) {
        Ok(params) => params,
        Err(message) => return error(StatusCode::BAD_REQUEST, "invalid_request_error", &message),
    };
    if let Err(message) = validate(&params) {
        return error(StatusCode::BAD_REQUEST, "invalid_request_error", &message);
    }
    let fingerprint = hex::encode(Sha256::digest(Value::Object(params.clone()).to_string()));

    // The idempotency layer: replay, refuse, or mark this key as executing.
    if let Some(key) = &key {
        let mut inner = provider.inner.lock().unwrap();
        let now = SystemTime::now();
        inner.keys.retain(|_, r| match r {
            Remembered::Done { at, .. } => {
                now.duration_since(*at).unwrap_or_default() < IDEMPOTENCY_WINDOW
            }
            Remembered::Executing => true,
        });
        match inner.keys.get(key) {
            Some(Remembered::Executing) => {
                return error(
                    StatusCode::CONFLICT,
                    "idempotency_error",
                    "There is currently another in-progress request using this Idempotency Key.",
                )
            }
            Some(Remembered::Done { parameters, .. }) if *parameters != fingerprint => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "idempotency_error",
                    "Keys for idempotent requests can only be used with the same parameters they were first used with.",
                )
            }
            Some(Remembered::Done { status, body, .. }) => {
                let mut response = (*status, Json(body.clone())).into_response();
                response.headers_mut().insert("idempotent-replayed", "true".parse().unwrap());
                return response;
            }
            None => {
                inner.keys.insert(key.clone(), Remembered::Executing);
            }
        }
    }

    tokio::time::sleep(delay).await;
    if fault == WriteFault::FailBeforeCommit {
        if let Some(key) = &key {
            provider.inner.lock().unwrap().keys.remove(key);
        }
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "An unexpected error occurred.",
        );
    }

    let created = SystemTime::now();
    let refund = json!({
        "id": format!("re_{}", &uuid::Uuid::new_v4().simple().to_string()[..24]),
        "object": "refund",
        "amount": params["amount"],
        "currency": params["currency"].as_str().unwrap_or_default().to_lowercase(),
        "payment_intent": params["payment_intent"],
        "metadata": params.get("metadata").cloned().unwrap_or_else(|| json!({})),
        "status": "succeeded",
        "created": now_secs(created),
    });
    {
        let mut inner = provider.inner.lock().unwrap();
        inner.refunds.push(Refund {
            body: refund.clone(),
            created,
        });
        inner.stats.refunds += 1;
        if let Some(key) = &key {
            inner.keys.insert(
                key.clone(),
                Remembered::Done {
                    parameters: fingerprint,
                    status: StatusCode::OK,
                    body: refund.clone(),
                    at: created,
                },
            );
        }
    }
    match fault {
        WriteFault::CommitThenDrop => drop_connection(),
        WriteFault::CommitThen500 => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "An unexpected error occurred.",
        ),
        WriteFault::CommitThenStall => {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Json(refund).into_response()
        }
        _ => Json(refund).into_response(),
    }
}

/// Applies the lookup faults; `Err` is the response to send instead.
async fn lookup_allowed(provider: &Provider) -> Result<Faults, Response> {
    let faults = {
        let mut inner = provider.inner.lock().unwrap();
        inner.stats.lookups += 1;
        inner.faults.clone()
    };
    tokio::time::sleep(Duration::from_millis(faults.delay_ms)).await;
    if faults.lookups_unavailable {
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "api_error",
            "Lookups are unavailable.",
        ));
    }
    Ok(faults)
}

async fn get_refund(State(provider): State<Provider>, Path(id): Path<String>) -> Response {
    if let Err(response) = lookup_allowed(&provider).await {
        return response;
    }
    let inner = provider.inner.lock().unwrap();
    match inner.refunds.iter().find(|r| r.body["id"] == id.as_str()) {
        Some(refund) => Json(refund.body.clone()).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &format!("No such refund: '{id}'"),
        ),
    }
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    payment_intent: Option<String>,
    limit: Option<usize>,
    starting_after: Option<String>,
}

async fn list_refunds(
    State(provider): State<Provider>,
    Query(query): Query<ListQuery>,
) -> Response {
    let faults = match lookup_allowed(&provider).await {
        Ok(faults) => faults,
        Err(response) => return response,
    };
    let limit = query.limit.unwrap_or(10);
    if !(1..=100).contains(&limit) {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "limit must be between 1 and 100",
        );
    }
    let inner = provider.inner.lock().unwrap();
    let now = SystemTime::now();
    let lag = Duration::from_millis(faults.list_lag_ms);
    let visible: Vec<&Refund> = inner
        .refunds
        .iter()
        .rev()
        .filter(|r| now.duration_since(r.created).unwrap_or_default() >= lag)
        .filter(|r| {
            query
                .payment_intent
                .as_deref()
                .is_none_or(|pi| r.body["payment_intent"] == pi)
        })
        .collect();
    let start = match &query.starting_after {
        None => 0,
        Some(cursor) => match visible.iter().position(|r| r.body["id"] == cursor.as_str()) {
            Some(i) => i + 1,
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "starting_after is not a refund in this list",
                )
            }
        },
    };
    let page: Vec<Value> = visible
        .iter()
        .skip(start)
        .take(limit)
        .map(|r| r.body.clone())
        .collect();
    let has_more = visible.len() > start + page.len();
    Json(json!({ "object": "list", "url": "/v1/refunds", "has_more": has_more, "data": page }))
        .into_response()
}

async fn set_faults(State(provider): State<Provider>, Json(faults): Json<Faults>) -> Json<Faults> {
    provider.set_faults(faults.clone());
    Json(faults)
}

async fn get_faults(State(provider): State<Provider>) -> Json<Faults> {
    Json(provider.inner.lock().unwrap().faults.clone())
}

async fn stats(State(provider): State<Provider>) -> Json<Stats> {
    Json(provider.stats())
}
