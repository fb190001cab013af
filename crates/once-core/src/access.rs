//! Who may call the ledger: tenants, the credentials bound to them, and the roles a credential
//! holds.
//!
//! A credential is an API key (a random secret the caller sends as a bearer token) or a client
//! certificate (when the ledger verifies them). Either is stored only as the SHA-256 of its
//! bytes, so the store never holds anything that lets someone call the ledger.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::Millis;

/// What a credential allows. A credential may hold several roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// An MCP server: Begin, the reports, Heartbeat, and GetOperation, in its tenant.
    Executor,
    /// Dashboards and status tools: GetOperation and ListOperations, in its tenant.
    Reader,
    /// On-call staff: what a reader may, plus Resolve and Reconcile, in its tenant.
    Operator,
    /// Whoever runs the ledger: tenants and credentials, of every tenant. Not operations.
    Admin,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Executor, Role::Reader, Role::Operator, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Executor => "executor",
            Role::Reader => "reader",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("unknown role {s:?}; roles: executor, reader, operator, admin"))
    }
}

/// A set of roles, written `executor,reader` where a column or a flag holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Roles(u8);

impl Roles {
    pub fn of(roles: impl IntoIterator<Item = Role>) -> Self {
        Roles(roles.into_iter().fold(0, |bits, r| bits | Self::bit(r)))
    }

    fn bit(role: Role) -> u8 {
        1 << role as u8
    }

    pub fn contains(self, role: Role) -> bool {
        self.0 & Self::bit(role) != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn iter(self) -> impl Iterator<Item = Role> {
        Role::ALL.into_iter().filter(move |r| self.contains(*r))
    }

    /// The roles a credential of `tenant` holds: `admin` only in [`LEDGER_TENANT`]. A key of
    /// another tenant stored with it (before the rule, or by hand) is admitted without it.
    pub fn held_in(self, tenant: &str) -> Roles {
        match tenant == LEDGER_TENANT {
            true => self,
            false => Roles(self.0 & !Self::bit(Role::Admin)),
        }
    }
}

impl fmt::Display for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.iter().map(Role::as_str).collect();
        f.write_str(&names.join(","))
    }
}

impl std::str::FromStr for Roles {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let roles = s
            .split(',')
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(str::parse)
            .collect::<Result<Vec<Role>, String>>()?;
        if roles.is_empty() {
            return Err("at least one role is needed".to_owned());
        }
        Ok(Roles::of(roles))
    }
}

/// The tenant of every caller while a ledger holds no credential, and the one a reconciler
/// serves when its configuration names none.
pub const DEFAULT_TENANT: &str = "default";

/// The ledger's own tenant, where the bootstrap admin key is stored: the only one whose keys
/// may hold the `admin` role, which is ledger-wide (it manages and reads every tenant).
pub const LEDGER_TENANT: &str = DEFAULT_TENANT;

/// Refuses `roles` for a credential of `tenant` when they include `admin` outside
/// [`LEDGER_TENANT`], saying why.
pub fn check_roles_for(tenant: &str, roles: Roles) -> Result<(), String> {
    if roles.contains(Role::Admin) && tenant != LEDGER_TENANT {
        return Err(format!(
            "the admin role is the ledger's, not a tenant's: only keys of tenant \"{LEDGER_TENANT}\" \
             may hold it (it manages and reads every tenant); give tenant {tenant:?}'s keys \
             executor, reader or operator"
        ));
    }
    Ok(())
}

/// A tenant name: 1 to 63 characters of `a-z`, `0-9`, `-` and `_`, starting with a letter or a
/// digit. Names are chosen by whoever runs the ledger; callers never send one.
pub fn check_tenant_name(name: &str) -> Result<(), String> {
    let well_formed = (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && name.as_bytes()[0].is_ascii_alphanumeric();
    if well_formed {
        Ok(())
    } else {
        Err(format!(
            "tenant {name:?} must be 1 to 63 characters of a-z, 0-9, - and _, starting with a letter or digit"
        ))
    }
}

/// A tenant and the limits that keep it from starving the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub name: String,
    pub created_at: Millis,
    /// The most operations of this tenant that may be IN_FLIGHT at once; `None` for no cap.
    pub max_in_flight: Option<i64>,
    /// The most requests per second each of its credentials may send; `None` for no cap.
    pub requests_per_second: Option<i64>,
}

/// What a credential is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialKind {
    /// A secret sent as `authorization: Bearer <key>`.
    Key,
    /// A client certificate presented in the TLS handshake, known by its SHA-256 fingerprint.
    Certificate,
}

impl CredentialKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CredentialKind::Key => "key",
            CredentialKind::Certificate => "certificate",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "key" => Some(CredentialKind::Key),
            "certificate" => Some(CredentialKind::Certificate),
            _ => None,
        }
    }
}

/// A stored credential: everything but the secret, which is never stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credential {
    /// Public and stable: names the credential in listings, revocations and recorded actors.
    pub key_id: String,
    pub tenant: String,
    /// Who it was given to, e.g. `refund-mcp-prod`.
    pub name: String,
    pub roles: Roles,
    pub kind: CredentialKind,
    pub created_at: Millis,
    pub revoked_at: Option<Millis>,
}

impl Credential {
    /// The credential as `onced keys` and `oncectl keys` print it for programs (`--json`):
    /// never a secret, times in milliseconds since the Unix epoch.
    pub fn to_json(&self) -> serde_json::Value {
        let roles: Vec<&str> = self.roles.iter().map(Role::as_str).collect();
        serde_json::json!({
            "key_id": self.key_id,
            "tenant": self.tenant,
            "name": self.name,
            "roles": roles,
            "kind": self.kind.as_str(),
            "created_at_ms": self.created_at,
            "revoked_at_ms": self.revoked_at,
        })
    }
}

/// A credential to store: its record and the hash of its secret.
#[derive(Debug, Clone)]
pub struct NewCredential {
    pub key_id: String,
    pub tenant: String,
    pub name: String,
    pub roles: Roles,
    pub kind: CredentialKind,
    pub secret_hash: SecretHash,
    /// Created on the word of a caller admitted while the ledger was open (no credential
    /// stored): stored only while that is still so, and of several such at once, one only.
    pub while_open: bool,
}

/// The SHA-256 of a key or of a certificate's DER bytes: what the store keeps and looks up by.
/// Keys are random and at least 128 bits long, so a plain hash cannot be reversed by guessing.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SecretHash(pub [u8; 32]);

impl SecretHash {
    pub fn of(secret: &[u8]) -> Self {
        SecretHash(Sha256::digest(secret).into())
    }

    /// The first bytes in hex, to tell certificates apart in listings.
    pub fn short_hex(&self) -> String {
        hex::encode(&self.0[..8])
    }

    /// The hash of a metrics token as its file holds it (surrounding whitespace is not part of
    /// it), once it is as strong as an API key must be.
    pub fn of_metrics_token(text: &str) -> Result<Self, String> {
        let token = text.trim();
        check_key_strength(token)
            .map_err(|message| message.replacen("an API key", "a metrics token", 1))?;
        Ok(SecretHash::of(token.as_bytes()))
    }

    /// A check that admits exactly the secret this is the hash of (a bearer token as sent, or
    /// nothing). Compared by hash, so the time taken says nothing of how much of it matched.
    pub fn admits(self) -> impl Fn(Option<&str>) -> bool + Clone + Send + Sync + 'static {
        move |sent| sent.is_some_and(|sent| SecretHash::of(sent.as_bytes()) == self)
    }
}

impl fmt::Debug for SecretHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretHash({}…)", self.short_hex())
    }
}

/// An API key as it is handed out, once: `once_<key id>_<secret>`. The key id is public; the
/// whole string is the secret. `Debug` shows only the key id.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    secret: String,
    /// Its key id: random, and never derived from the secret.
    id: String,
}

/// The prefix of every key the ledger generates, so secret scanners and people recognise one.
pub const API_KEY_PREFIX: &str = "once_";

/// Fewest bits a key supplied from outside must carry by its length and alphabet: 32 random
/// bytes' worth (64 hex digits, 43 base64 characters).
pub const MIN_KEY_BITS: f64 = 256.0;
/// Fewest different characters a supplied key must have.
const MIN_DISTINCT: usize = 10;

/// Refuses a key supplied from outside (the bootstrap admin key) that could be guessed. It
/// checks the key's shape, not its origin: its length times the bits of its alphabet — 16
/// symbols when it is hex digits of one case (not digits alone), else 10 for digits, 26 for each case of letters
/// and 32 for anything else, summed over the classes it uses — must reach [`MIN_KEY_BITS`];
/// it must have digits or letters of both cases (letters of one case alone are the shape of
/// words), at least 10 different characters, none making up more than a quarter of it; and it
/// must not be one shorter text repeated. Random bytes in hex or base64 pass; words, a
/// pattern or a short key do not.
pub fn check_key_strength(secret: &str) -> Result<(), String> {
    const ADVICE: &str = "use 32 random bytes, e.g. `openssl rand -hex 32`";
    let chars: Vec<char> = secret.chars().collect();
    if chars.is_empty() || chars.iter().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "an API key is one word, with no spaces or control characters: {ADVICE}"
        ));
    }
    let has = |test: fn(&char) -> bool| chars.iter().any(test);
    let (digits, lower, upper) = (
        has(char::is_ascii_digit),
        has(char::is_ascii_lowercase),
        has(char::is_ascii_uppercase),
    );
    let other = has(|c| !c.is_ascii_alphanumeric());
    // Hex digits of one case, with a letter among them: digits alone are decimal.
    let hex = chars.iter().all(char::is_ascii_hexdigit)
        && chars.iter().any(char::is_ascii_alphabetic)
        && !(lower && upper);
    let alphabet = if hex {
        16
    } else {
        [(digits, 10), (lower, 26), (upper, 26), (other, 32)]
            .iter()
            .filter(|(used, _)| *used)
            .map(|(_, size)| size)
            .sum()
    };
    let bits = chars.len() as f64 * f64::from(alphabet).log2();
    if bits < MIN_KEY_BITS {
        return Err(format!(
            "an API key of {} characters from an alphabet of {alphabet} carries at most {bits:.0} bits; at least {MIN_KEY_BITS:.0} are needed: {ADVICE}",
            chars.len()
        ));
    }
    let mut counts = std::collections::HashMap::new();
    for c in &chars {
        *counts.entry(c).or_insert(0usize) += 1;
    }
    let most = counts.values().copied().max().unwrap_or(0);
    let repeated = (1..=chars.len() / 2).any(|period| {
        chars
            .iter()
            .enumerate()
            .all(|(i, c)| *c == chars[i % period])
    });
    // Letters of one case and no digit is the shape of words, whatever their length.
    let words = !(digits || (lower && upper));
    if words || counts.len() < MIN_DISTINCT || most * 4 > chars.len() || repeated {
        return Err(format!(
            "an API key must not be words or a pattern: it needs digits or letters of both cases, at least {MIN_DISTINCT} different characters, none more than a quarter of it, and not one text repeated: {ADVICE}"
        ));
    }
    Ok(())
}

impl ApiKey {
    /// A new key from 32 random bytes (`random`), with a 12-hex-digit key id from 6 more.
    pub fn generate(random: [u8; 38]) -> Self {
        let (id, secret) = random.split_at(6);
        ApiKey {
            secret: format!(
                "{API_KEY_PREFIX}{}_{}",
                hex::encode(id),
                hex::encode(secret)
            ),
            id: hex::encode(id),
        }
    }

    /// A key supplied from outside (the bootstrap key), checked for strength
    /// ([`check_key_strength`]), with a key id drawn from `random`: nothing of the key, not even
    /// a hash of it, shows in listings, logs or recorded actors.
    pub fn supplied(secret: String, random: [u8; 6]) -> Result<Self, String> {
        let secret = secret.trim().to_owned();
        check_key_strength(&secret)?;
        Ok(ApiKey {
            secret,
            id: hex::encode(random),
        })
    }

    /// The key's id: a generated key carries it; a supplied one was given it at random.
    pub fn key_id(&self) -> String {
        self.id.clone()
    }

    pub fn hash(&self) -> SecretHash {
        SecretHash::of(self.secret.as_bytes())
    }

    /// The secret itself, to hand to its holder once or to send as a bearer token.
    pub fn expose(&self) -> &str {
        &self.secret
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ApiKey({}, <redacted>)", self.key_id())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_read_and_write_as_a_list() {
        let roles: Roles = "reader, operator".parse().unwrap();
        assert!(roles.contains(Role::Operator) && roles.contains(Role::Reader));
        assert!(!roles.contains(Role::Executor));
        assert_eq!(roles.to_string(), "reader,operator");
        assert_eq!(roles.to_string().parse::<Roles>().unwrap(), roles);
        assert!("".parse::<Roles>().is_err());
        assert!("root".parse::<Roles>().is_err());
    }

    #[test]
    fn generated_keys_carry_their_id_and_never_show_their_secret() {
        let key = ApiKey::generate([7; 38]);
        assert!(key.expose().starts_with("once_070707070707_"));
        assert_eq!(key.expose().len(), 5 + 12 + 1 + 64);
        assert_eq!(key.key_id(), "070707070707");
        let shown = format!("{key:?}");
        assert!(!shown.contains(&key.expose()[18..]), "{shown}");
        assert_ne!(key.hash(), ApiKey::generate([8; 38]).hash());
    }

    #[test]
    fn the_admin_role_lives_in_the_ledger_tenant_only() {
        let admin = Roles::of([Role::Reader, Role::Admin]);
        assert!(check_roles_for(LEDGER_TENANT, admin).is_ok());
        let refused = check_roles_for("acme", admin).unwrap_err();
        assert!(
            refused.contains("only keys of tenant \"default\""),
            "{refused}"
        );
        assert!(check_roles_for("acme", Roles::of([Role::Reader, Role::Operator])).is_ok());
        assert_eq!(admin.held_in(LEDGER_TENANT), admin);
        assert_eq!(admin.held_in("acme"), Roles::of([Role::Reader]));
    }

    /// Hex of 32 bytes from a fixed, well-mixed sequence.
    fn random_hex(seed: u64) -> String {
        let mut state = seed;
        (0..32)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                format!("{:02x}", (state >> 56) as u8)
            })
            .collect()
    }

    #[test]
    fn a_supplied_key_carries_32_random_bytes_worth() {
        for strong in [
            random_hex(1),
            random_hex(2).to_uppercase(),
            // `openssl rand -base64 32`
            "q3V0+Xk2cR9tYb1LmN8pZ4wE7sJ0uH6gA5fD2oK1iC8=".to_owned(),
            format!("prod-admin-{}", random_hex(3)),
        ] {
            assert!(check_key_strength(&strong).is_ok(), "{strong}");
        }
        for (weak, why) in [
            ("short", "bits"),
            (&random_hex(4)[..60], "bits"),
            // 64 decimal digits carry 213 bits, not 256.
            (
                "3141592653589793238462643383279502884197169399375105820974944592",
                "bits",
            ),
            (&"ab".repeat(40), "pattern"),
            (&format!("test-admin-{}", "9f".repeat(20)), "pattern"),
            (&"0123456789abcdef".repeat(5), "pattern"),
            (
                "correct-horse-battery-staple-correct-horse-battery",
                "pattern",
            ),
            (&format!("{} {}", random_hex(5), random_hex(6)), "spaces"),
        ] {
            let refused = check_key_strength(weak).expect_err(weak);
            let said = match why {
                "bits" => "bits",
                "pattern" => "words or a pattern",
                _ => "no spaces",
            };
            assert!(refused.contains(said), "{weak}: {refused}");
            assert!(
                !refused.contains(weak),
                "the refusal repeats the key: {refused}"
            );
        }
    }

    #[test]
    fn a_supplied_key_gets_a_random_id_that_shows_nothing_of_it() {
        let secret = format!("once_0123456789ab_{}", random_hex(7));
        let key = ApiKey::supplied(format!("{secret}\n"), [0xa5; 6]).unwrap();
        assert_eq!(key.expose(), secret);
        assert_eq!(key.key_id(), "a5a5a5a5a5a5");
        assert!(!secret.contains(&key.key_id()));
        assert!(!key.hash().short_hex().contains(&key.key_id()));
        assert!(ApiKey::supplied("short".into(), [0; 6]).is_err());
    }

    #[test]
    fn tenant_names_are_plain() {
        assert!(check_tenant_name("acme-prod_1").is_ok());
        for bad in ["", "Acme", "-x", "a b", &"a".repeat(64)] {
            assert!(check_tenant_name(bad).is_err(), "{bad:?}");
        }
    }
}
