//! Conversions between `once.admin.v1` messages and the domain's tenants and credentials.
//! What a tenant name or a key name may be is checked where they are created, for the gRPC
//! service and `onced`'s commands alike; here only the message's own spelling is read.

use once_core::access::{Credential, Roles, Tenant};
use once_core::Invalid;

use crate::admin_pb as pb;
use crate::convert::timestamp;

/// A limit as a message carries it: 0 means no cap.
pub fn cap(value: i64) -> Option<i64> {
    (value != 0).then_some(value)
}

/// The roles a CreateKey names.
pub fn roles(names: &[String]) -> Result<Roles, Invalid> {
    let roles = names
        .iter()
        .map(|r| r.parse())
        .collect::<Result<Vec<_>, String>>()
        .map_err(|m| Invalid::new("roles", m))?;
    Ok(Roles::of(roles))
}

pub fn tenant(t: Tenant) -> pb::Tenant {
    pb::Tenant {
        name: t.name,
        created_at: Some(timestamp(t.created_at)),
        #[allow(deprecated)]
        created_at_ms: t.created_at,
        max_in_flight: t.max_in_flight.unwrap_or(0),
        requests_per_second: t.requests_per_second.unwrap_or(0),
    }
}

pub fn key(c: Credential) -> pb::Key {
    pb::Key {
        key_id: c.key_id,
        tenant: c.tenant,
        name: c.name,
        roles: c.roles.iter().map(|r| r.to_string()).collect(),
        kind: c.kind.as_str().to_owned(),
        created_at: Some(timestamp(c.created_at)),
        revoked_at: c.revoked_at.map(timestamp),
        #[allow(deprecated)]
        created_at_ms: c.created_at,
        #[allow(deprecated)]
        revoked_at_ms: c.revoked_at.unwrap_or(0),
    }
}

pub fn list_tenants_response(tenants: Vec<Tenant>) -> pb::ListTenantsResponse {
    pb::ListTenantsResponse {
        tenants: tenants.into_iter().map(tenant).collect(),
    }
}

/// A created credential, and its secret when one was generated (shown this once; none for a
/// registered certificate).
pub fn create_key_response(credential: Credential, secret: Option<&str>) -> pb::CreateKeyResponse {
    pb::CreateKeyResponse {
        key: Some(key(credential)),
        secret: secret.unwrap_or_default().to_owned(),
    }
}

pub fn list_keys_response(keys: Vec<Credential>) -> pb::ListKeysResponse {
    pb::ListKeysResponse {
        keys: keys.into_iter().map(key).collect(),
    }
}

#[cfg(test)]
mod tests {
    use once_core::access::{CredentialKind, Role, Roles};

    use super::*;

    #[test]
    #[allow(deprecated)]
    fn a_key_is_sent_with_its_times_in_both_spellings() {
        let sent = key(Credential {
            key_id: "2fa1ee5785ef".into(),
            tenant: "acme".into(),
            name: "oncall".into(),
            roles: Roles::of([Role::Reader]),
            kind: CredentialKind::Key,
            created_at: 1_700_000_000_000,
            revoked_at: Some(1_700_000_500_000),
        });
        assert_eq!(sent.created_at, Some(timestamp(1_700_000_000_000)));
        assert_eq!(sent.revoked_at, Some(timestamp(1_700_000_500_000)));
        assert_eq!(
            (sent.created_at_ms, sent.revoked_at_ms),
            (1_700_000_000_000, 1_700_000_500_000)
        );
    }
}
