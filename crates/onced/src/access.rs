//! Who is calling, and what they may do.
//!
//! Every RPC is admitted here before anything else runs: the caller's credential (a bearer API
//! key, or a client certificate the TLS handshake verified) is hashed and looked up, and the
//! caller becomes a [`Principal`]: the tenant the credential is bound to, its roles, and its
//! tenant's limits. The tenant is never read from a request.
//!
//! Every replica holds all credentials in memory (a small table: hashes, tenants, roles), read
//! again on the first call after `--credential-ttl` has passed, so a credential created or
//! revoked through any replica takes effect on every replica within that bound, and a key the
//! ledger does not know costs no database query at all.
//!
//! While no credential exists, the ledger is open: every caller is tenant `default` with every
//! role (local development; `onced` refuses to listen open beyond loopback unless told
//! `--insecure`). Credentials are never deleted, only revoked, so the first one stored closes it
//! for good, on every replica within the same bound.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use once_api::convert::TenantRead;
use once_core::access::{Credential, CredentialKind, Role, SecretHash, Tenant};
use once_core::{Actor, Scope};
use once_store::{Backend, StoreError};
use tokio::time::Instant;
use tonic::{Request, Status};

use crate::status;

pub use once_core::access::{DEFAULT_TENANT, LEDGER_TENANT};

/// An admitted caller.
#[derive(Debug, Clone)]
pub struct Principal {
    pub tenant: String,
    /// The credential it presented; `None` while the ledger is open.
    pub credential: Option<Credential>,
    /// The hash of what it presented, to check again that it still admits it.
    presented: Option<Presented>,
    /// Its tenant's cap on IN_FLIGHT operations.
    pub max_in_flight: Option<i64>,
    /// Its tenant's request rate, per credential.
    requests_per_second: Option<i64>,
}

impl Principal {
    fn open() -> Self {
        Principal {
            tenant: DEFAULT_TENANT.to_owned(),
            credential: None,
            presented: None,
            max_in_flight: None,
            requests_per_second: None,
        }
    }

    /// The executor recorded for this caller's attempts: the name its credential was given,
    /// which the caller cannot choose, or while the ledger is open the client name it sends.
    pub fn executor(&self, client_name: Option<&str>) -> Actor {
        let name = match &self.credential {
            Some(credential) => credential.name.as_str(),
            None => client_name
                .filter(|n| !n.is_empty())
                .unwrap_or(DEFAULT_TENANT),
        };
        Actor::Executor(name.to_owned())
    }

    /// The credential an attempt this principal begins is granted to: only it reports for the
    /// attempt. `None` while the ledger is open.
    pub fn holder(&self) -> once_core::Holder {
        self.credential.as_ref().map(|c| c.key_id.clone())
    }

    /// The operator recorded as asking for a lookup: the name given, or the credential's name
    /// when none was; with the credential it came with.
    pub fn asker(&self, given: &str) -> Actor {
        match (&self.credential, given) {
            (Some(credential), "") => Actor::Operator(credential.name.clone()),
            (None, "") => Actor::Operator("anonymous".to_owned()),
            _ => self.operator(given),
        }
    }

    /// The operator recorded for a resolution: the name given, and the credential it came with.
    pub fn operator(&self, given: &str) -> Actor {
        match &self.credential {
            Some(credential) if credential.name != given => {
                Actor::Operator(format!("{given}@{}", credential.name))
            }
            _ => Actor::Operator(given.to_owned()),
        }
    }
}

/// The hash of a presented secret, which its `Debug` does not show.
#[derive(Clone)]
struct Presented(SecretHash, CredentialKind);

impl std::fmt::Debug for Presented {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Presented")
            .field(&self.1)
            .finish_non_exhaustive()
    }
}

/// Which roles may make a call (any one of them suffices), and whether the call counts against
/// its credential's request rate.
#[derive(Debug, Clone, Copy)]
pub struct Allowed {
    roles: &'static [Role],
    rate_limited: bool,
}

impl Allowed {
    pub const EXECUTOR: Allowed = Allowed::limited(&[Role::Executor]);
    /// Reports and heartbeats settle or keep alive an effect already under way: refusing one
    /// would turn a known outcome UNKNOWN, so they count against the rate only when they
    /// settled nothing ([`Access::charge`]).
    pub const SETTLE: Allowed = Allowed {
        roles: &[Role::Executor],
        rate_limited: false,
    };
    pub const READ_ONE: Allowed = Allowed::limited(&[Role::Executor, Role::Reader, Role::Operator]);
    pub const READ: Allowed = Allowed::limited(&[Role::Reader, Role::Operator]);
    pub const OPERATOR: Allowed = Allowed::limited(&[Role::Operator]);
    pub const ADMIN: Allowed = Allowed::limited(&[Role::Admin]);
    /// Any role: for a read naming a tenant, whose roles [`Access::admit_read`] checks itself,
    /// and for a caller asking who it is.
    pub const ANY: Allowed =
        Allowed::limited(&[Role::Executor, Role::Reader, Role::Operator, Role::Admin]);

    const fn limited(roles: &'static [Role]) -> Self {
        Allowed {
            roles,
            rate_limited: true,
        }
    }

    fn describe(self) -> String {
        let names: Vec<&str> = self.roles.iter().map(|r| r.as_str()).collect();
        names.join(" or ")
    }
}

/// Admits callers. Cheap to clone; clones share the caches.
#[derive(Clone)]
pub struct Access<B> {
    inner: Arc<Inner<B>>,
}

impl<B> std::fmt::Debug for Access<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("ttl", &self.inner.ttl)
            .finish_non_exhaustive()
    }
}

struct Inner<B> {
    backend: B,
    ttl: Duration,
    credentials: Mutex<Arc<Credentials>>,
    /// Held while the credentials are read again, so a burst of calls reads them once.
    reading: tokio::sync::Mutex<()>,
    buckets: Mutex<HashMap<String, Bucket>>,
    in_flight: Mutex<HashMap<String, (Instant, i64)>>,
}

/// Every credential as last read, by the hash of its secret.
struct Credentials {
    /// When they were read; `None` once this replica changed one, to read them at once.
    read_at: Option<Instant>,
    /// Every change through this version is in `by_hash`: a refresh reads only later ones.
    through: i64,
    by_hash: Arc<HashMap<SecretHash, (Credential, Tenant)>>,
}

impl Credentials {
    /// Nothing read yet.
    fn none() -> Self {
        Self {
            read_at: None,
            through: -1,
            by_hash: Arc::default(),
        }
    }

    /// Open: no credential exists, revoked or not.
    fn open(&self) -> bool {
        self.by_hash.is_empty()
    }
}

impl<B: Backend> Access<B> {
    /// Reads the credentials: open when there is none.
    pub async fn new(backend: B, ttl: Duration) -> Result<Self, StoreError> {
        let credentials = read(&backend, &Credentials::none()).await?;
        for (credential, tenant) in credentials.by_hash.values() {
            let held = credential.roles.held_in(&tenant.name);
            if held != credential.roles && credential.revoked_at.is_none() {
                tracing::warn!(
                    key_id = %credential.key_id,
                    tenant = %tenant.name,
                    "this key was stored with the admin role outside tenant \"{LEDGER_TENANT}\"; \
                     it is admitted without it (the admin role is the ledger's): revoke it and \
                     create an admin key in \"{LEDGER_TENANT}\" if it should administer"
                );
            }
        }
        Ok(Self {
            inner: Arc::new(Inner {
                backend,
                ttl,
                credentials: Mutex::new(Arc::new(credentials)),
                reading: tokio::sync::Mutex::new(()),
                buckets: Mutex::default(),
                in_flight: Mutex::default(),
            }),
        })
    }

    /// Whether callers are admitted without a credential, as last read.
    pub fn is_open(&self) -> bool {
        self.current().open()
    }

    /// Makes the next call read the credentials again, after this replica stored or revoked
    /// one: the change takes effect here at once (other replicas see it within their TTL).
    pub fn changed(&self) {
        let mut current = self.inner.credentials.lock().expect("not poisoned");
        let stale = Credentials {
            read_at: None,
            through: current.through,
            by_hash: current.by_hash.clone(),
        };
        *current = Arc::new(stale);
    }

    fn current(&self) -> Arc<Credentials> {
        self.inner.credentials.lock().expect("not poisoned").clone()
    }

    /// The credentials, read again if they are older than the TTL.
    async fn credentials(&self) -> Result<Arc<Credentials>, StoreError> {
        self.credentials_within(self.inner.ttl).await
    }

    /// The credentials, read again if they are older than `max_age`.
    async fn credentials_within(&self, max_age: Duration) -> Result<Arc<Credentials>, StoreError> {
        let fresh = |c: &Credentials| c.read_at.is_some_and(|at| at.elapsed() < max_age);
        let current = self.current();
        if fresh(&current) {
            return Ok(current);
        }
        let _reading = self.inner.reading.lock().await;
        let current = self.current();
        if fresh(&current) {
            return Ok(current);
        }
        self.read_now(&current).await
    }

    /// Reads the credentials now, whatever the TTL: what changed since `current` was read.
    async fn read_now(&self, current: &Credentials) -> Result<Arc<Credentials>, StoreError> {
        let read = Arc::new(read(&self.inner.backend, current).await?);
        if current.open() && !read.open() {
            tracing::warn!("a credential now exists: every caller must present one");
        }
        *self.inner.credentials.lock().expect("not poisoned") = read.clone();
        Ok(read)
    }

    /// Admits the caller of `request` if it may make a call `allowed` names.
    pub async fn admit<T>(
        &self,
        request: &Request<T>,
        allowed: Allowed,
    ) -> Result<Principal, Status> {
        let mut credentials = self.credentials().await.map_err(status::store)?;
        // An open ledger's admin calls (a first tenant, a first key) are never admitted from
        // what was read before: another replica may have closed it since.
        if credentials.open() && allowed.roles == [Role::Admin] {
            credentials = self.read_now(&credentials).await.map_err(status::store)?;
        }
        if credentials.open() {
            return Ok(Principal::open());
        }
        let (hash, kind) = presented(request)?;
        let (credential, tenant) = standing(&credentials, &hash, kind)?;
        if !allowed.roles.iter().any(|r| credential.roles.contains(*r)) {
            return Err(status::permission_denied(
                &allowed.describe(),
                &credential.roles.to_string(),
            ));
        }
        if let Some(rate) = tenant.requests_per_second.filter(|_| allowed.rate_limited) {
            self.take_token(&credential.key_id, rate)?;
        }
        Ok(Principal {
            tenant: tenant.name,
            max_in_flight: tenant.max_in_flight,
            requests_per_second: tenant.requests_per_second,
            credential: Some(credential),
            presented: Some(Presented(hash, kind)),
        })
    }

    /// Charges a call admitted free of the rate ([`Allowed::SETTLE`]) that settled nothing (it
    /// named an operation or attempt that does not exist, or is not the caller's) to its
    /// credential's rate: refused once the rate is spent, so such calls cannot flood the store.
    pub fn charge(&self, principal: &Principal) -> Result<(), Status> {
        match (&principal.credential, principal.requests_per_second) {
            (Some(credential), Some(rate)) => self.take_token(&credential.key_id, rate),
            _ => Ok(()),
        }
    }

    /// Whether the credential `principal` was admitted with admits it still, as the
    /// credentials were read at most half the TTL ago: for a stream, which outlives its
    /// admission and checks every half TTL ([`Access::recheck_every`]), so a revocation ends it
    /// within the TTL. A caller admitted while the ledger was open is refused once it has
    /// closed.
    pub async fn still_admits(&self, principal: &Principal) -> Result<(), Status> {
        let credentials = self
            .credentials_within(self.recheck_every())
            .await
            .map_err(status::store)?;
        match &principal.presented {
            Some(Presented(hash, kind)) => standing(&credentials, hash, *kind).map(drop),
            None if credentials.open() => Ok(()),
            None => Err(status::unauthenticated(
                "CREDENTIALS_MISSING",
                "this ledger requires a credential now: send `authorization: Bearer <API key>` or a client certificate",
            )),
        }
    }

    /// How often a stream checks that its credential still admits it: half the TTL, so that
    /// with a reading at most as old, a revocation is seen within the TTL.
    pub fn recheck_every(&self) -> Duration {
        self.inner.ttl / 2
    }

    /// Admits a read of a tenant's operations and says whose: the caller's own tenant when the
    /// request names none (or names it), with a role `allowed` names; any tenant, for a key
    /// with the admin role (which is ledger-wide). Naming another tenant without it is refused
    /// the same way whichever tenant is named, so the refusal says nothing of that tenant.
    pub async fn admit_read<T: TenantRead>(
        &self,
        request: &Request<T>,
        allowed: Allowed,
    ) -> Result<String, Status> {
        Ok(self.admit_reader(request, allowed).await?.1)
    }

    /// [`Access::admit_read`], with the caller it admitted.
    pub async fn admit_reader<T: TenantRead>(
        &self,
        request: &Request<T>,
        allowed: Allowed,
    ) -> Result<(Principal, String), Status> {
        let named = request.get_ref().tenant();
        if named.is_empty() {
            let principal = self.admit(request, allowed).await?;
            let tenant = principal.tenant.clone();
            return Ok((principal, tenant));
        }
        let principal = self.admit(request, Allowed::ANY).await?;
        let roles = principal.credential.as_ref().map(|c| c.roles);
        let holds = |role: Role| roles.is_none_or(|held| held.contains(role));
        if named == principal.tenant && allowed.roles.iter().any(|r| holds(*r)) {
            let tenant = principal.tenant.clone();
            return Ok((principal, tenant));
        }
        require_admin(&principal)?;
        once_core::access::check_tenant_name(named)
            .map_err(|message| status::invalid(once_core::Invalid::new("tenant", message)))?;
        Ok((principal, named.to_owned()))
    }

    /// [`Access::admit_reader`] for a read that may cover every tenant (`all_tenants`), which
    /// only the admin role may (it is ledger-wide), and which names no tenant besides.
    pub async fn admit_scoped<T: TenantRead>(
        &self,
        request: &Request<T>,
        allowed: Allowed,
    ) -> Result<(Principal, Scope), Status> {
        if !request.get_ref().all_tenants() {
            let (principal, tenant) = self.admit_reader(request, allowed).await?;
            return Ok((principal, Scope::Tenant(tenant)));
        }
        let principal = self.admit(request, Allowed::ANY).await?;
        require_admin(&principal)?;
        if !request.get_ref().tenant().is_empty() {
            let message = "names one tenant while all_tenants asks for every tenant: send one";
            return Err(status::invalid(once_core::Invalid::new("tenant", message)));
        }
        Ok((principal, Scope::AllTenants))
    }

    /// Refuses a Begin that would start a new execution while its tenant holds its cap of
    /// IN_FLIGHT operations ([`once_core::machine::starts_execution`]). Any other Begin goes on:
    /// it replays, waits or is told the state, which costs the tenant nothing. The count is read
    /// at most every 250 ms per replica and counts what this replica lets through meanwhile, so
    /// the cap can be passed only by what other replicas begin within that time.
    pub async fn check_in_flight(
        &self,
        principal: &Principal,
        cmd: &once_core::BeginCommand,
    ) -> Result<(), Status> {
        let Some(cap) = principal.max_in_flight else {
            return Ok(());
        };
        let count = self
            .in_flight(&principal.tenant)
            .await
            .map_err(status::store)?;
        if count < cap {
            // Counted as begun until the next reading, so a burst cannot pass the cap by more
            // than other replicas begin meanwhile.
            if let Some((_, cached)) = self
                .inner
                .in_flight
                .lock()
                .expect("not poisoned")
                .get_mut(&principal.tenant)
            {
                *cached += 1;
            }
            return Ok(());
        }
        let (op, now) = self
            .inner
            .backend
            .read(&principal.tenant, &cmd.operation_id)
            .await
            .map_err(status::store)?;
        if !once_core::machine::starts_execution(op.as_ref(), cmd, now) {
            return Ok(());
        }
        Err(status::exhausted(
            "TOO_MANY_IN_FLIGHT",
            format!(
                "the tenant has {count} operations in flight, its cap is {cap}; nothing was done and the call is safe to send again later"
            ),
            self.inner.ttl.max(Duration::from_secs(1)),
        ))
    }

    fn take_token(&self, key_id: &str, rate: i64) -> Result<(), Status> {
        let mut buckets = self.inner.buckets.lock().expect("not poisoned");
        let bucket = buckets
            .entry(key_id.to_owned())
            .or_insert_with(|| Bucket::full(rate));
        bucket.take(rate, Instant::now()).map_err(|wait| {
            status::exhausted(
                "RATE_LIMITED",
                format!(
                    "this credential may send {rate} requests a second; nothing was done and the call is safe to send again after {} ms",
                    wait.as_millis()
                ),
                wait,
            )
        })
    }

    async fn in_flight(&self, tenant: &str) -> Result<i64, StoreError> {
        if let Some((at, count)) = self
            .inner
            .in_flight
            .lock()
            .expect("not poisoned")
            .get(tenant)
        {
            if at.elapsed() < self.inner.ttl.min(Duration::from_millis(250)) {
                return Ok(*count);
            }
        }
        let count = self.inner.backend.in_flight(tenant).await?;
        self.inner
            .in_flight
            .lock()
            .expect("not poisoned")
            .insert(tenant.to_owned(), (Instant::now(), count));
        Ok(count)
    }
}

/// The credential and tenant of a secret's hash, if it admits anyone.
fn standing(
    credentials: &Credentials,
    hash: &SecretHash,
    kind: CredentialKind,
) -> Result<(Credential, Tenant), Status> {
    let Some((mut credential, tenant)) = credentials.by_hash.get(hash).cloned() else {
        return Err(status::unknown_credential());
    };
    credential.roles = credential.roles.held_in(&tenant.name);
    // A certificate is public: it identifies a caller only when the handshake proved the
    // caller holds its private key, never when its bytes arrive as a bearer token.
    if credential.kind != kind {
        return Err(status::unknown_credential());
    }
    if credential.revoked_at.is_some() {
        return Err(status::unauthenticated(
            "CREDENTIALS_REVOKED",
            "the credential was revoked; ask for a new one",
        ));
    }
    Ok((credential, tenant))
}

/// Every credential in the store: `current`, with what changed since it was read. Credentials
/// are never deleted (a revoked one stays, revoked), so what changed replaces what was held.
async fn read<B: Backend>(backend: &B, current: &Credentials) -> Result<Credentials, StoreError> {
    let changes = backend.credentials_since(current.through).await?;
    let by_hash = match changes.changed.is_empty() {
        true => current.by_hash.clone(),
        false => {
            let mut by_hash = HashMap::clone(&current.by_hash);
            for (hash, credential, tenant) in changes.changed {
                by_hash.insert(hash, (credential, tenant));
            }
            Arc::new(by_hash)
        }
    };
    Ok(Credentials {
        read_at: Some(Instant::now()),
        through: changes.through,
        by_hash,
    })
}

/// The hash of the credential a request presents: its bearer key, or else the client
/// certificate its connection was verified with.
fn presented<T>(request: &Request<T>) -> Result<(SecretHash, CredentialKind), Status> {
    if let Some(value) = request.metadata().get("authorization") {
        let key = value
            .to_str()
            .ok()
            .and_then(|v| {
                let (scheme, key) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
            })
            .filter(|key| !key.is_empty())
            .ok_or_else(|| {
                status::unauthenticated(
                    "CREDENTIALS_INVALID",
                    "the authorization header must be `Bearer <API key>`",
                )
            })?;
        return Ok((SecretHash::of(key.as_bytes()), CredentialKind::Key));
    }
    if let Some(certificate) = request
        .peer_certs()
        .as_ref()
        .and_then(|c| c.first().cloned())
    {
        return Ok((
            SecretHash::of(certificate.as_ref()),
            CredentialKind::Certificate,
        ));
    }
    Err(status::unauthenticated(
        "CREDENTIALS_MISSING",
        "this ledger requires a credential: send `authorization: Bearer <API key>` or a client certificate",
    ))
}

/// A token bucket: `rate` requests a second, in bursts of at most `rate`.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(rate: i64) -> Self {
        Bucket {
            tokens: rate.max(1) as f64,
            at: Instant::now(),
        }
    }

    /// Takes one token, or says how long until one is there.
    fn take(&mut self, rate: i64, now: Instant) -> Result<(), Duration> {
        let rate = rate.max(1) as f64;
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(rate);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / rate))
        }
    }
}

/// Refuses a caller without the admin role (on an open ledger every caller holds every role),
/// alike whatever it asked for, so the refusal says nothing of the tenant it named.
fn require_admin(principal: &Principal) -> Result<(), Status> {
    match principal.credential.as_ref().map(|c| c.roles) {
        Some(held) if !held.contains(Role::Admin) => {
            Err(status::permission_denied("admin", &held.to_string()))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_allows_its_rate_and_says_when_to_come_back() {
        let start = Instant::now();
        let mut bucket = Bucket {
            tokens: 2.0,
            at: start,
        };
        assert!(bucket.take(2, start).is_ok());
        assert!(bucket.take(2, start).is_ok());
        let wait = bucket.take(2, start).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        assert!(bucket.take(2, start + wait).is_ok());
        // Idle time refills no more than one second's worth.
        assert!(bucket.take(2, start + Duration::from_secs(60)).is_ok());
        assert!(bucket.take(2, start + Duration::from_secs(60)).is_ok());
        assert!(bucket.take(2, start + Duration::from_secs(60)).is_err());
    }
}
