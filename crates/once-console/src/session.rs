//! Console sessions: an API key, exchanged once at sign-in for a random session id that the
//! browser holds in an `HttpOnly` cookie. The key stays here, in memory: it never reaches a
//! page, a script or the browser's storage, and it is sent to the ledger with every call the
//! session makes, so the ledger checks it (and its revocation) each time.
//!
//! A session ends when it has been idle for `idle`, when it is older than `lifetime`, at
//! sign-out, or at the first call the ledger refuses for its key (revoked, or expired).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use once_client::LedgerClient;
use tokio::time::Instant;

/// The most sessions held at once: signing in beyond it is refused, never at the cost of
/// another's session...
const MAX_SESSIONS: usize = 10_000;
/// ...and the most one key holds: beyond it, that key's session idle longest ends.
const MAX_SESSIONS_PER_KEY: usize = 16;

/// Who a session is, as the ledger said at sign-in.
#[derive(Clone)]
pub(crate) struct Session {
    /// The ledger client carrying the session's key.
    pub(crate) client: LedgerClient,
    /// The key, for the session's live streams' own clients; never sent to the browser.
    pub(crate) key: String,
    pub(crate) tenant: String,
    /// The key's name and id; empty in open mode (no credentials exist).
    pub(crate) key_name: String,
    pub(crate) key_id: String,
    pub(crate) roles: Vec<String>,
    /// Sent back with every form that changes something; compared in constant time.
    pub(crate) csrf: String,
    created: Instant,
    last_seen: Instant,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("tenant", &self.tenant)
            .field("key_id", &self.key_id)
            .field("roles", &self.roles)
            .finish_non_exhaustive()
    }
}

impl Session {
    pub(crate) fn new(
        client: LedgerClient,
        key: String,
        tenant: String,
        key_name: String,
        key_id: String,
        roles: Vec<String>,
    ) -> Self {
        let now = Instant::now();
        Self {
            client,
            key,
            tenant,
            key_name,
            key_id,
            roles,
            csrf: random_token(),
            created: now,
            last_seen: now,
        }
    }

    /// Whether the key may settle operations (reconcile, resolve).
    pub(crate) fn operates(&self) -> bool {
        self.roles.iter().any(|role| role == "operator")
    }
}

/// The live sessions of one console.
#[derive(Clone)]
pub(crate) struct Sessions {
    held: Arc<Mutex<HashMap<String, Session>>>,
    idle: Duration,
    lifetime: Duration,
}

impl Sessions {
    pub(crate) fn new(idle: Duration, lifetime: Duration) -> Self {
        Self {
            held: Arc::default(),
            idle,
            lifetime,
        }
    }

    /// Keeps `session`; returns its id, for the cookie, or `None` when the console holds all
    /// the sessions it may.
    pub(crate) fn open(&self, session: Session) -> Option<String> {
        let id = random_token();
        let mut held = self.held.lock().expect("not poisoned");
        let now = Instant::now();
        held.retain(|_, s| self.alive(s, now));
        let of_key: Vec<(String, Instant)> = held
            .iter()
            .filter(|(_, s)| s.key_id == session.key_id)
            .map(|(id, s)| (id.clone(), s.last_seen))
            .collect();
        if of_key.len() >= MAX_SESSIONS_PER_KEY {
            if let Some((stalest, _)) = of_key.iter().min_by_key(|(_, seen)| *seen) {
                held.remove(stalest);
            }
        }
        if held.len() >= MAX_SESSIONS {
            return None;
        }
        held.insert(id.clone(), session);
        Some(id)
    }

    /// The session `id` names, if it is live; `touch` starts its idle clock again (a request a
    /// person made, not one the live page made by itself).
    pub(crate) fn get(&self, id: &str, touch: bool) -> Option<Session> {
        self.get_at(id, Instant::now(), touch)
    }

    fn get_at(&self, id: &str, now: Instant, touch: bool) -> Option<Session> {
        let mut held = self.held.lock().expect("not poisoned");
        let live = held.get(id).is_some_and(|s| self.alive(s, now));
        if !live {
            held.remove(id);
            return None;
        }
        let session = held.get_mut(id)?;
        if touch {
            session.last_seen = now;
        }
        Some(session.clone())
    }

    /// Whether the session `id` names is live, without touching it.
    pub(crate) fn live(&self, id: &str) -> bool {
        let held = self.held.lock().expect("not poisoned");
        held.get(id).is_some_and(|s| self.alive(s, Instant::now()))
    }

    /// How long a session lasts at most.
    pub(crate) fn lifetime(&self) -> Duration {
        self.lifetime
    }

    pub(crate) fn end(&self, id: &str) {
        self.held.lock().expect("not poisoned").remove(id);
    }

    fn alive(&self, session: &Session, now: Instant) -> bool {
        now.duration_since(session.last_seen) < self.idle
            && now.duration_since(session.created) < self.lifetime
    }
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.held.lock().map(|held| held.len()).unwrap_or_default();
        f.debug_struct("Sessions")
            .field("held", &held)
            .field("idle", &self.idle)
            .field("lifetime", &self.lifetime)
            .finish()
    }
}

/// 256 random bits, hex-encoded.
pub(crate) fn random_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).expect("the operating system's random source");
    hex::encode(bytes)
}

/// Whether two tokens are equal, in time that does not depend on where they differ.
pub(crate) fn same_token(a: &str, b: &str) -> bool {
    use subtle::ConstantTimeEq as _;
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session() -> Session {
        let client = LedgerClient::over_channel(
            tonic::transport::Endpoint::from_static("http://unused.invalid").connect_lazy(),
            once_client::ClientConfig::new("unused"),
        )
        .expect("a client without a key");
        Session::new(
            client,
            "secret".into(),
            "acme".into(),
            "oncall".into(),
            "key_1".into(),
            vec!["reader".into()],
        )
    }

    #[tokio::test]
    async fn a_session_ends_when_idle_and_when_old_however_busy() {
        let sessions = Sessions::new(Duration::from_secs(60), Duration::from_secs(300));
        let opened = Instant::now();
        let idle = sessions.open(session()).expect("room");
        let busy = sessions.open(session()).expect("room");
        let watched = sessions.open(session()).expect("room");
        let at = |seconds| opened + Duration::from_secs(seconds);
        assert!(sessions.get_at(&idle, at(59), true).is_some());
        assert!(
            sessions.get_at(&idle, at(119), true).is_none(),
            "idle past its limit"
        );
        for seconds in [50, 100, 150, 200, 250] {
            assert!(
                sessions.get_at(&busy, at(seconds), true).is_some(),
                "each request restarts its idle clock"
            );
        }
        assert!(
            sessions.get_at(&busy, at(301), true).is_none(),
            "older than its lifetime"
        );
        assert!(sessions.get_at(&watched, at(50), false).is_some());
        assert!(
            sessions.get_at(&watched, at(61), false).is_none(),
            "what the live page asks by itself does not keep a session alive"
        );
    }

    #[tokio::test]
    async fn a_session_ended_is_gone_and_ids_are_not_guessable_from_each_other() {
        let sessions = Sessions::new(Duration::from_secs(60), Duration::from_secs(300));
        let first = sessions.open(session()).expect("room");
        let second = sessions.open(session()).expect("room");
        assert_ne!(first, second);
        assert_eq!(first.len(), 64);
        sessions.end(&first);
        assert!(sessions.get(&first, true).is_none());
        assert!(sessions.get(&second, true).is_some());
        assert_ne!(
            sessions.get(&second, true).map(|s| s.csrf),
            Some(second.clone()),
            "the CSRF token is not the session id"
        );
    }

    #[tokio::test]
    async fn one_key_holds_a_bounded_number_of_sessions_and_others_keep_theirs() {
        let sessions = Sessions::new(Duration::from_secs(60), Duration::from_secs(300));
        let mut other = session();
        other.key_id = "key_2".into();
        let kept = sessions.open(other).expect("room");
        let first = sessions.open(session()).expect("room");
        for _ in 1..MAX_SESSIONS_PER_KEY {
            sessions.open(session()).expect("room");
        }
        assert!(sessions.get(&first, false).is_some());
        sessions.open(session()).expect("room");
        assert!(
            sessions.get(&first, false).is_none(),
            "the key's stalest session ended"
        );
        assert!(
            sessions.get(&kept, false).is_some(),
            "another key's session stays"
        );
        assert!(
            !format!("{sessions:?}").contains(&kept),
            "Debug shows no session id"
        );
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same_token("abc", "abc"));
        assert!(!same_token("abc", "abd"));
        assert!(!same_token("abc", "ab"));
        assert!(!same_token("", "a"));
    }
}
