//! The reconciler section of `onced --config FILE` (TOML).
//!
//! ```toml
//! [reconciliation]
//! interval = "1s"        # how often each replica looks for due operations
//! first_backoff = "1s"   # pause after the first inconclusive lookup, doubled each time…
//! max_backoff = "5m"     # …up to this
//! claim = "30s"          # how long a replica holds an operation it is looking up
//! escalate_after_lookups = 10        # an operation still UNKNOWN after this many lookups…
//! escalate_after = "1h"              # …or this long after its last attempt began is ESCALATED
//! webhook = "https://oncall.example/hooks/once"   # and POSTed here (optional)
//!
//! [[reconciler]]
//! name = "stripe"                    # the `provider` operations name
//! kind = "stripe"
//! endpoint = "https://api.stripe.com"
//! api_key_env = "STRIPE_API_KEY"     # the credential comes from the environment, never the file
//! timeout = "5s"
//! settle_time = "2s"
//! dashboard = "https://dashboard.stripe.com/search?query={provider_key}"   # a link (optional)
//! ```
//!
//! A reconciler serves the tenants it is configured for (`default` unless it says), each with
//! its own credential: an operation is only ever looked up with its own tenant's.
//!
//! ```toml
//! [[reconciler]]
//! name = "stripe"
//! kind = "stripe"
//! endpoint = "https://api.stripe.com"
//! api_key_env = { acme = "ACME_STRIPE_KEY", globex = "GLOBEX_STRIPE_KEY" }
//! ```

use std::sync::Arc;
use std::time::Duration;

use once_core::access::DEFAULT_TENANT;
use serde::Deserialize;

use crate::grpc::GrpcReconciler;
use crate::http::HttpReconciler;
use crate::stripe::StripeReconciler;
use crate::{Backoff, Capabilities, Escalation, Registered, Registry};

/// Why a configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("the configuration is not valid TOML: {0}")]
    Toml(#[from] toml::de::Error),
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    reconciliation: Option<SettingsFile>,
    #[serde(default)]
    reconciler: Vec<ReconcilerFile>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct SettingsFile {
    interval: Option<String>,
    first_backoff: Option<String>,
    max_backoff: Option<String>,
    claim: Option<String>,
    escalate_after_lookups: Option<u32>,
    escalate_after: Option<String>,
    webhook: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReconcilerFile {
    name: String,
    kind: String,
    endpoint: String,
    api_key_env: Option<ApiKeyEnv>,
    /// The tenants served, when no credential names them (default: `default`).
    tenants: Option<Vec<String>>,
    timeout: Option<String>,
    settle_time: Option<String>,
    /// A link to an operation in the provider's dashboard: an https:// URL template with
    /// {provider_key} and {provider_ref}.
    dashboard: Option<String>,
    // The `http` kind's settings.
    url: Option<String>,
    found_status: Option<Vec<u16>>,
    not_found_status: Option<Vec<u16>>,
    provider_ref_pointer: Option<String>,
    result_pointer: Option<String>,
    miss_is_authoritative: Option<bool>,
    dedupes_by_provider_key: Option<bool>,
    // The `sql` kind's: the marker table (default `once_effects`).
    table: Option<String>,
}

/// Where a reconciler's credential comes from: one variable (for one tenant), or one per tenant.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ApiKeyEnv {
    One(String),
    PerTenant(std::collections::BTreeMap<String, String>),
}

/// The tenants a reconciler serves, each with the variable holding its credential.
fn served(
    r: &ReconcilerFile,
    field: &dyn Fn(&str) -> String,
) -> Result<Vec<(String, Option<String>)>, ConfigError> {
    let named = || {
        r.tenants
            .clone()
            .unwrap_or_else(|| vec![DEFAULT_TENANT.to_owned()])
    };
    let served: Vec<(String, Option<String>)> = match &r.api_key_env {
        Some(ApiKeyEnv::PerTenant(_)) if r.tenants.is_some() => {
            return Err(invalid(
                field("tenants"),
                "api_key_env already names the tenants served: leave tenants out",
            ))
        }
        Some(ApiKeyEnv::PerTenant(by_tenant)) => by_tenant
            .iter()
            .map(|(t, v)| (t.clone(), Some(v.clone())))
            .collect(),
        Some(ApiKeyEnv::One(variable)) => match named().as_slice() {
            [tenant] => vec![(tenant.clone(), Some(variable.clone()))],
            _ => {
                return Err(invalid(
                    field("api_key_env"),
                    "one credential cannot serve several tenants: give one variable per tenant, api_key_env = { tenant = \"VARIABLE\" }",
                ))
            }
        },
        None => named().into_iter().map(|t| (t, None)).collect(),
    };
    if served.is_empty() {
        return Err(invalid(field("tenants"), "must name at least one tenant"));
    }
    for (tenant, _) in &served {
        once_core::access::check_tenant_name(tenant).map_err(|m| invalid(field("tenants"), m))?;
    }
    Ok(served)
}

/// How the reconciliation workers run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub interval: Duration,
    pub backoff: Backoff,
    pub claim: Duration,
    pub escalation: Escalation,
    /// Where escalations are POSTed, if anywhere.
    pub webhook: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(1),
            backoff: Backoff {
                first_ms: 1_000,
                max_ms: 300_000,
            },
            claim: Duration::from_secs(30),
            escalation: Escalation::default(),
            webhook: None,
        }
    }
}

/// The parsed configuration: worker settings and the reconcilers.
#[derive(Debug, Clone, Default)]
pub struct Reconciliation {
    pub settings: Settings,
    pub registry: Registry,
}

fn duration(field: &str, value: Option<&str>, default: Duration) -> Result<Duration, ConfigError> {
    match value {
        None => Ok(default),
        Some(text) => humantime::parse_duration(text).map_err(|e| invalid(field, e.to_string())),
    }
}

/// An `http` lookup's URL template. It must name the effect by `{provider_key}`: an operation id
/// is shared by every life of the operation (and by other tenants), so a lookup by it alone
/// could credit this life with an earlier life's effect.
fn http_url(url: Option<&str>) -> Result<String, String> {
    let url = url.ok_or("the http kind needs a url template")?;
    if !url.contains("{provider_key}") {
        return Err(
            "must contain {provider_key}: the lookup must find the effect of this life of the operation, \
             which only its provider key names (record it with the effect)"
                .to_owned(),
        );
    }
    Ok(url.to_owned())
}

/// Parses `text`; credentials are read with `env` (the process environment in production).
pub fn parse(
    text: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Reconciliation, ConfigError> {
    let file: File = toml::from_str(text)?;
    let defaults = Settings::default();
    let s = file.reconciliation.unwrap_or_default();
    let settings = Settings {
        interval: duration(
            "reconciliation.interval",
            s.interval.as_deref(),
            defaults.interval,
        )?,
        backoff: Backoff {
            first_ms: once_core::duration_ms(duration(
                "reconciliation.first_backoff",
                s.first_backoff.as_deref(),
                Duration::from_millis(defaults.backoff.first_ms as u64),
            )?),
            max_ms: once_core::duration_ms(duration(
                "reconciliation.max_backoff",
                s.max_backoff.as_deref(),
                Duration::from_millis(defaults.backoff.max_ms as u64),
            )?),
        },
        claim: duration("reconciliation.claim", s.claim.as_deref(), defaults.claim)?,
        escalation: Escalation {
            after_lookups: s.escalate_after_lookups,
            after_ms: s
                .escalate_after
                .as_deref()
                .map(|text| {
                    duration("reconciliation.escalate_after", Some(text), Duration::ZERO)
                        .map(once_core::duration_ms)
                })
                .transpose()?,
        },
        webhook: s.webhook,
    };
    if settings.interval.is_zero()
        || settings.backoff.first_ms <= 0
        || settings.backoff.max_ms < settings.backoff.first_ms
    {
        return Err(invalid(
            "reconciliation",
            "intervals must be positive and max_backoff at least first_backoff",
        ));
    }
    let mut registry = Registry::default();
    for (i, r) in file.reconciler.iter().enumerate() {
        let field = |name: &str| format!("reconciler[{i}].{name}");
        if r.name.is_empty() || registry.names().any(|(_, name)| name == r.name) {
            return Err(invalid(field("name"), "must be present and unique"));
        }
        let timeout = duration(
            &field("timeout"),
            r.timeout.as_deref(),
            Duration::from_secs(5),
        )?;
        let settle_time = duration(
            &field("settle_time"),
            r.settle_time.as_deref(),
            Duration::from_secs(5),
        )?;
        // A lookup must end well before its claim lapses, or another replica starts a second.
        if settings.claim < timeout * 2 {
            return Err(invalid(
                field("timeout"),
                format!(
                    "{timeout:?} leaves no margin in the {:?} lookup claim: make reconciliation.claim at least twice the timeout",
                    settings.claim
                ),
            ));
        }
        let dashboard = r
            .dashboard
            .as_deref()
            .map(crate::dashboard::Dashboard::parse)
            .transpose()
            .map_err(|m| invalid(field("dashboard"), m))?;
        for (tenant, variable) in served(r, &field)? {
            let api_key = match &variable {
                None => None,
                Some(variable) => Some(env(variable).ok_or_else(|| {
                    invalid(
                        field("api_key_env"),
                        format!("the environment has no {variable}"),
                    )
                })?),
            };
            let reconciler = build(r, &field, api_key, settle_time, timeout)?;
            registry.insert(
                &tenant,
                Registered {
                    name: r.name.clone(),
                    reconciler,
                    backoff: settings.backoff,
                    escalation: settings.escalation,
                    timeout,
                    dashboard: dashboard.clone(),
                },
            );
        }
    }
    Ok(Reconciliation { settings, registry })
}

/// One reconciler of `r`'s kind, with one tenant's credential.
fn build(
    r: &ReconcilerFile,
    field: &dyn Fn(&str) -> String,
    api_key: Option<String>,
    settle_time: Duration,
    timeout: Duration,
) -> Result<Arc<dyn crate::Reconciler>, ConfigError> {
    let reconciler: Arc<dyn crate::Reconciler> = match r.kind.as_str() {
        "stripe" => Arc::new(
            StripeReconciler::new(&r.endpoint, api_key, settle_time, timeout)
                .map_err(|e| invalid(field("endpoint"), e.to_string()))?,
        ),
        "http" => Arc::new(HttpReconciler {
            endpoint: r.endpoint.clone(),
            url: http_url(r.url.as_deref()).map_err(|m| invalid(field("url"), m))?,
            found_status: r.found_status.clone().unwrap_or_else(|| vec![200]),
            not_found_status: r.not_found_status.clone().unwrap_or_else(|| vec![404]),
            provider_ref_pointer: r
                .provider_ref_pointer
                .clone()
                .unwrap_or_else(|| "/id".into()),
            result_pointer: r.result_pointer.clone().unwrap_or_default(),
            capabilities: Capabilities {
                miss_is_authoritative: r.miss_is_authoritative.unwrap_or(false),
                settle_time_ms: once_core::duration_ms(settle_time),
                dedupes_by_provider_key: r.dedupes_by_provider_key.unwrap_or(false),
            },
            api_key,
            http: HttpReconciler::client(timeout)
                .map_err(|e| invalid(field("endpoint"), e.to_string()))?,
        }),
        "grpc" => Arc::new(
            GrpcReconciler::new(&r.endpoint, api_key, timeout)
                .map_err(|e| invalid(field("endpoint"), e.to_string()))?,
        ),
        // The credential is the database user's password; the endpoint names the rest.
        "sql" => Arc::new(
            crate::sql::SqlReconciler::new(
                &r.endpoint,
                api_key,
                r.table.as_deref().unwrap_or("once_effects"),
                timeout,
            )
            .map_err(|e| invalid(field("endpoint"), e))?,
        ),
        other => {
            return Err(invalid(
                field("kind"),
                format!("unknown kind {other:?}; known: stripe, http, grpc, sql"),
            ))
        }
    };
    Ok(reconciler)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"
        [reconciliation]
        interval = "250ms"
        max_backoff = "1m"

        [[reconciler]]
        name = "payments"
        kind = "stripe"
        endpoint = "http://127.0.0.1:12111"
        api_key_env = "PAYMENTS_KEY"
        settle_time = "2s"
    "#;

    proptest::proptest! {
        /// The reconciler file, mangled: read or refused with a reason, never a panic, and
        /// never a secret from the environment in the refusal.
        #[test]
        fn fuzz_config_parse_accepts_or_refuses(text in once_core::fuzzing::mangled(CONFIG)) {
            if let Err(error) = parse(&text, |_| Some("sk_test_secret".to_owned())) {
                proptest::prop_assert!(!error.to_string().contains("sk_test_secret"));
            }
        }
    }

    #[test]
    fn parses_reconcilers_with_credentials_from_the_environment() {
        let text = CONFIG;
        let parsed = parse(text, |name| {
            (name == "PAYMENTS_KEY").then(|| "sk_test_secret".to_owned())
        })
        .unwrap();
        assert_eq!(parsed.settings.interval, Duration::from_millis(250));
        assert_eq!(parsed.settings.backoff.max_ms, 60_000);
        let stripe = parsed.registry.get("default", "payments").unwrap();
        assert_eq!(stripe.policy(64).capabilities.settle_time_ms, 2_000);
        let shown = format!("{:?}", parsed.registry);
        assert!(
            shown.contains("<redacted>") && !shown.contains("sk_test_secret"),
            "{shown}"
        );
    }

    #[test]
    fn a_dashboard_link_is_an_https_template_or_onced_does_not_start() {
        let with = |dashboard: &str| {
            parse(
                &format!("{CONFIG}\n        dashboard = \"{dashboard}\"\n"),
                |_| Some("k".to_owned()),
            )
        };
        let parsed = with("https://dash.example/search?q={provider_key}").unwrap();
        let payments = parsed.registry.get("default", "payments").unwrap();
        let link = payments.dashboard.as_ref().unwrap().link(None, "once_1");
        assert_eq!(
            link.as_deref(),
            Some("https://dash.example/search?q=once_1")
        );
        let refused = with("javascript:alert({provider_key})")
            .unwrap_err()
            .to_string();
        assert!(refused.contains("reconciler[0].dashboard"), "{refused}");
        assert!(parse(CONFIG, |_| Some("k".to_owned()))
            .unwrap()
            .registry
            .get("default", "payments")
            .unwrap()
            .dashboard
            .is_none());
    }

    #[test]
    fn each_tenant_gets_its_own_credential() {
        let text = r#"
            [[reconciler]]
            name = "payments"
            kind = "stripe"
            endpoint = "http://127.0.0.1:12111"
            api_key_env = { acme = "ACME_KEY", globex = "GLOBEX_KEY" }
        "#;
        let parsed = parse(text, |name| Some(format!("secret-of-{name}"))).unwrap();
        let mut served: Vec<(&str, &str)> = parsed.registry.names().collect();
        served.sort();
        assert_eq!(served, [("acme", "payments"), ("globex", "payments")]);
        assert!(parsed.registry.get(DEFAULT_TENANT, "payments").is_none());
    }

    #[test]
    fn the_sql_kind_reads_its_marker_table_with_each_tenants_password() {
        let text = r#"
            [[reconciler]]
            name = "bookings"
            kind = "sql"
            endpoint = "postgres://bookings@127.0.0.1:5432/bookings"
            table = "booking_effects"
            api_key_env = { acme = "ACME_DB_PASSWORD" }
        "#;
        let parsed = parse(text, |_| Some("secret".to_owned())).unwrap();
        let found = parsed.registry.get("acme", "bookings").unwrap();
        let shown = format!("{:?}", found.reconciler);
        assert!(
            !shown.contains("secret") && shown.contains("bookings@127.0.0.1:5432/bookings"),
            "{shown}"
        );
        let capabilities = found.reconciler.capabilities();
        assert!(capabilities.miss_is_authoritative && capabilities.dedupes_by_provider_key);
        let unplain = text.replace("booking_effects", "effects; DROP TABLE x");
        let refused = parse(&unplain, |_| Some("secret".to_owned())).unwrap_err();
        assert!(refused.to_string().contains("marker table"), "{refused}");
        let not_a_database =
            text.replace("postgres://bookings@127.0.0.1:5432/bookings", "http://x");
        let refused = parse(&not_a_database, |_| Some("secret".to_owned())).unwrap_err();
        assert!(
            refused.to_string().contains("postgres:// or sqlite:"),
            "{refused}"
        );
    }

    #[test]
    fn refuses_what_it_cannot_use() {
        let missing_env = "[[reconciler]]\nname = \"s\"\nkind = \"stripe\"\nendpoint = \"http://x\"\napi_key_env = \"NOPE\"";
        assert!(matches!(
            parse(missing_env, |_| None),
            Err(ConfigError::Invalid { .. })
        ));
        let unknown_kind =
            "[[reconciler]]\nname = \"s\"\nkind = \"carrier-pigeon\"\nendpoint = \"http://x\"";
        assert!(parse(unknown_kind, |_| None)
            .unwrap_err()
            .to_string()
            .contains("carrier-pigeon"));
        let secret_in_file = "[[reconciler]]\nname = \"s\"\nkind = \"stripe\"\nendpoint = \"http://x\"\napi_key = \"sk_live\"";
        assert!(
            matches!(parse(secret_in_file, |_| None), Err(ConfigError::Toml(_))),
            "credentials never go in the file"
        );
        let by_operation_id = "[[reconciler]]\nname = \"t\"\nkind = \"http\"\nendpoint = \"http://x\"\nurl = \"{endpoint}/t/{operation_id}\"";
        assert!(parse(by_operation_id, |_| None)
            .unwrap_err()
            .to_string()
            .contains("{provider_key}"));
        let short_claim = "[reconciliation]\nclaim = \"5s\"\n[[reconciler]]\nname = \"s\"\nkind = \"stripe\"\nendpoint = \"http://x\"\ntimeout = \"5s\"";
        assert!(parse(short_claim, |_| None)
            .unwrap_err()
            .to_string()
            .contains("twice the timeout"));
        let shared_credential = "[[reconciler]]\nname = \"s\"\nkind = \"stripe\"\nendpoint = \"http://x\"\ntenants = [\"a\", \"b\"]\napi_key_env = \"K\"";
        assert!(parse(shared_credential, |_| Some("k".into()))
            .unwrap_err()
            .to_string()
            .contains("one credential cannot serve several tenants"));
        let named_twice = "[[reconciler]]\nname = \"s\"\nkind = \"stripe\"\nendpoint = \"http://x\"\ntenants = [\"a\"]\napi_key_env = { a = \"K\" }";
        assert!(parse(named_twice, |_| Some("k".into())).is_err());
        let bad_tenant = "[[reconciler]]\nname = \"s\"\nkind = \"stripe\"\nendpoint = \"http://x\"\ntenants = [\"Not A Tenant\"]";
        assert!(parse(bad_tenant, |_| None).is_err());
        let duplicate = "[[reconciler]]\nname = \"s\"\nkind = \"stripe\"\nendpoint = \"http://x\"\n[[reconciler]]\nname = \"s\"\nkind = \"stripe\"\nendpoint = \"http://y\"";
        assert!(parse(duplicate, |_| None).is_err());
    }
}
