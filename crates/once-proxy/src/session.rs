//! The ids of one client session: which of the client's ids are in use, the proxy's own ids
//! its guarded calls travel under, and the cancellations that follow them.
//!
//! An upstream answers by id. If a guarded call travelled under the client's id, any other
//! request under that id (a `ping`, a retry, `1.0` for `1`) would draw an answer the proxy took
//! for the call's, and a call given up on would hand its late answer to the next call under its
//! id. So a guarded call goes upstream under an id the proxy makes ([`Minter`]), only the
//! answer carrying that id is judged for it, and the client's id is its own again once the
//! proxy has answered; a client id is refused for any request while an answer to it may come.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

use tokio_util::sync::CancellationToken;

use crate::guard::RESERVED;
use crate::message::{IdKey, Json};

/// The most requests of one session whose answers may still come: an upstream that never
/// answers some (a cancelled request, an id it cannot read) cannot make the set grow without
/// end.
pub const MAX_IN_FLIGHT: usize = 4096;

/// How many cancelled requests' ids stay refused.
const MAX_CANCELLED: usize = 1024;

/// Makes the ids (and progress tokens) guarded calls travel under upstream: a random prefix
/// per proxy, under [`RESERVED`], which no client message may use, and a counter.
#[derive(Debug)]
pub struct Minter {
    prefix: String,
    next: AtomicU64,
}

impl Minter {
    pub fn new() -> Self {
        let mut random = [0u8; 8];
        // Without randomness the prefix is still reserved: only unguessable across proxies.
        let _ = getrandom::getrandom(&mut random);
        Self {
            prefix: format!("{RESERVED}{}:", hex::encode(random)),
            next: AtomicU64::new(1),
        }
    }

    pub fn mint(&self) -> String {
        format!(
            "{}{}",
            self.prefix,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// Whether `id` is one this proxy made.
    pub fn owns(&self, id: &str) -> bool {
        id.starts_with(&self.prefix)
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

/// One guarded call of the session, by the client's id.
#[derive(Debug)]
struct Guarded {
    /// The proxy's id for it, once it has been sent upstream.
    sent_as: Option<String>,
    /// Set when the client cancels it.
    cancel: CancellationToken,
}

/// What a session has in flight.
#[derive(Debug, Default)]
pub struct Session {
    /// The client's request ids whose answer may still come: its requests passed upstream and
    /// not yet answered, and its guarded calls not yet answered by the proxy.
    in_use: HashSet<IdKey>,
    guarded: HashMap<IdKey, Guarded>,
    /// The latest passed requests the client cancelled: still refused as ids, at most
    /// [`MAX_CANCELLED`] of them.
    cancelled: VecDeque<IdKey>,
}

/// A message cleared to pass upstream.
#[derive(Debug)]
pub struct Passing {
    /// What to send: the message, with a cancellation of a guarded call under the proxy's id
    /// (or left out, when the call was not sent yet). None when nothing is left to send.
    pub forwarded: Option<Json>,
    /// The ids of the `tools/list` requests in it.
    pub listings: Vec<IdKey>,
    /// The ids of its requests, in use until [`Session::answered`].
    pub claimed: Vec<IdKey>,
}

fn in_use(id: &Json) -> String {
    format!("the id {id} is in use by a request whose answer may still come; use a fresh id")
}

impl Session {
    /// Clears a message the guard passed: its requests' ids must be free (they are then in use
    /// until [`Session::answered`]), and a cancellation of a guarded call is translated.
    pub fn pass(&mut self, message: &Json) -> Result<Passing, String> {
        let (items, batch) = match message {
            Json::Array(items) => (items.as_slice(), true),
            single => (std::slice::from_ref(single), false),
        };
        let mut claimed = HashSet::new();
        for item in items {
            if item.get("method").is_none() {
                continue;
            }
            let Some(id) = item.get("id") else { continue };
            let Some(key) = IdKey::of(id) else { continue };
            if self.in_use.contains(&key) || self.cancelled.contains(&key) || !claimed.insert(key) {
                return Err(in_use(id));
            }
        }
        if self.in_use.len() + claimed.len() > MAX_IN_FLIGHT {
            return Err(format!(
                "more than {MAX_IN_FLIGHT} requests of this session wait for an answer"
            ));
        }
        let mut listings = Vec::new();
        let mut kept = Vec::new();
        for item in items {
            let method = item.get("method").and_then(Json::as_str);
            if method == Some("tools/list") {
                listings.extend(item.get("id").and_then(IdKey::of));
            }
            if method == Some("notifications/cancelled") {
                if let Some(cancelled) = self.cancel(item) {
                    kept.extend(cancelled);
                    continue;
                }
            }
            kept.push(item.clone());
        }
        let claimed: Vec<IdKey> = claimed.into_iter().collect();
        self.in_use.extend(claimed.iter().cloned());
        let forwarded = match (batch, kept.len()) {
            (_, 0) => None,
            (true, _) => Some(Json::Array(kept)),
            (false, _) => kept.pop(),
        };
        Ok(Passing {
            forwarded,
            listings,
            claimed,
        })
    }

    /// A cancellation naming one of the session's guarded calls: cancels it, and gives what to
    /// forward (the cancellation under the proxy's id, or nothing when the call has not been
    /// sent). None when it names no guarded call.
    fn cancel(&mut self, cancellation: &Json) -> Option<Option<Json>> {
        let params = cancellation.get("params")?;
        let key = IdKey::of(params.get("requestId")?)?;
        let Some(guarded) = self.guarded.get(&key) else {
            // A passed request the client gave up on: an upstream need not answer it (the
            // TypeScript SDK does not). Its id stays refused among the latest cancelled ones,
            // in case an answer comes after all, and leaves the ids in use.
            if self.in_use.remove(&key) {
                self.cancelled.push_back(key);
                if self.cancelled.len() > MAX_CANCELLED {
                    self.cancelled.pop_front();
                }
            }
            return None;
        };
        guarded.cancel.cancel();
        Some(guarded.sent_as.as_ref().map(|proxy_id| {
            let mut translated = cancellation.clone();
            if let Some(params) = translated.get_mut("params") {
                params.set("requestId", Json::String(proxy_id.clone()));
            }
            translated
        }))
    }

    /// The upstream answered the client's request `key`: the id is free again.
    pub fn answered(&mut self, key: &IdKey) {
        if !self.guarded.contains_key(key) {
            self.in_use.remove(key);
            self.cancelled.retain(|k| k != key);
        }
    }

    /// Takes the id of a guarded call; its cancellation token. Refused while the id is in use.
    pub fn guard(&mut self, id: &Json) -> Result<(IdKey, CancellationToken), String> {
        let key = IdKey::of(id)
            .ok_or_else(|| "a guarded call's id is a string or a number".to_owned())?;
        if self.cancelled.contains(&key) || !self.in_use.insert(key.clone()) {
            return Err(in_use(id));
        }
        let cancel = CancellationToken::new();
        self.guarded.insert(
            key.clone(),
            Guarded {
                sent_as: None,
                cancel: cancel.clone(),
            },
        );
        Ok((key, cancel))
    }

    /// The guarded call `key` is about to go upstream as `proxy_id`; false when the client has
    /// cancelled it, and it must not be sent.
    pub fn sending(&mut self, key: &IdKey, proxy_id: &str) -> bool {
        match self.guarded.get_mut(key) {
            Some(guarded) if !guarded.cancel.is_cancelled() => {
                guarded.sent_as = Some(proxy_id.to_owned());
                true
            }
            _ => false,
        }
    }

    /// The proxy has answered the guarded call `key` (or the client cancelled it): its id is
    /// the client's to use again. A late upstream answer carries the proxy's id, not this one.
    pub fn finished(&mut self, key: &IdKey) {
        self.guarded.remove(key);
        self.in_use.remove(key);
    }

    /// Whether nothing is in flight.
    pub fn is_idle(&self) -> bool {
        self.in_use.is_empty() && self.guarded.is_empty() && self.cancelled.is_empty()
    }
}

/// `request` as it travels upstream: under the proxy's id, and its progress token (if it asked
/// for progress) the proxy's id too. The client's progress token, to give back the upstream's
/// progress notifications under.
pub fn under_proxy_id(request: &mut Json, proxy_id: &str) -> Option<Json> {
    request.set("id", Json::String(proxy_id.to_owned()));
    let meta = request.get_mut("params")?.get_mut("_meta")?;
    let token = meta.get("progressToken")?.clone();
    meta.set("progressToken", Json::String(proxy_id.to_owned()));
    Some(token)
}

/// An upstream progress notification under the proxy's token, given back under the client's.
pub fn progress_for_client(notification: &mut serde_json::Value, client_token: &Json) {
    if let Some(params) = notification
        .get_mut("params")
        .and_then(|p| p.as_object_mut())
    {
        params.insert("progressToken".into(), client_token.to_value());
    }
}

/// The progress token of an upstream `notifications/progress`, when it is one of the proxy's.
pub fn proxy_progress_token<'n>(
    minter: &Minter,
    notification: &'n serde_json::Value,
) -> Option<&'n str> {
    if notification.get("method")?.as_str()? != "notifications/progress" {
        return None;
    }
    let token = notification.get("params")?.get("progressToken")?.as_str()?;
    minter.owns(token).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::parse;

    fn json(text: &str) -> Json {
        parse(text.as_bytes()).unwrap()
    }

    /// A ping under `id`, as JSON-RPC writes it (`7`, `"seven"`).
    fn ping(id: impl std::fmt::Display) -> Json {
        json(&format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"ping"}}"#))
    }

    #[test]
    fn an_id_in_use_is_refused_for_any_request_until_its_answer() {
        let mut session = Session::default();
        session.pass(&ping(1)).unwrap();
        // 1.0 is 1 to the upstream.
        assert!(session
            .pass(&json(r#"{"jsonrpc":"2.0","id":1.0,"method":"tools/list"}"#))
            .unwrap_err()
            .contains("in use"));
        assert!(session.guard(&json("1")).is_err());
        // A notification or a response carries no id of the client's.
        session
            .pass(&json(
                r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            ))
            .unwrap();
        session
            .pass(&json(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#))
            .unwrap();
        session.answered(&IdKey::of(&json("1")).unwrap());
        session.pass(&ping(1)).unwrap();
        // Two requests under one id in one batch.
        assert!(session
            .pass(&json(r#"[{"jsonrpc":"2.0","id":2,"method":"ping"},{"jsonrpc":"2.0","id":"2","method":"ping"},{"jsonrpc":"2.0","id":2,"method":"ping"}]"#))
            .is_err());
    }

    #[test]
    fn a_session_holds_a_bounded_number_of_ids() {
        let mut session = Session::default();
        for n in 0..MAX_IN_FLIGHT {
            session.pass(&ping(n)).unwrap();
        }
        let refused = session.pass(&ping(r#""one-more""#)).unwrap_err();
        assert!(refused.contains("wait for an answer"), "{refused}");
        session.answered(&IdKey::of(&json("0")).unwrap());
        session.pass(&ping(r#""one-more""#)).unwrap();
    }

    #[test]
    fn a_guarded_calls_id_is_free_once_the_proxy_answered_it() {
        let mut session = Session::default();
        let (key, _) = session.guard(&json("7")).unwrap();
        assert!(session.pass(&ping(7)).is_err());
        assert!(session.guard(&json("7.0")).is_err());
        // An upstream answer under the client's id is not the guarded call's.
        session.answered(&key);
        assert!(session.guard(&json("7")).is_err());
        session.finished(&key);
        assert!(session.is_idle());
        session.pass(&ping(7)).unwrap();
    }

    #[test]
    fn a_cancellation_follows_the_guarded_call_under_the_proxys_id() {
        let minter = Minter::new();
        let mut session = Session::default();
        let cancel = |id: &str| {
            json(&format!(
                r#"{{"jsonrpc":"2.0","method":"notifications/cancelled","params":{{"requestId":{id},"reason":"user"}}}}"#
            ))
        };
        // Not sent yet: the cancellation goes nowhere, and the call is never sent.
        let (early, early_token) = session.guard(&json("1")).unwrap();
        assert!(session.pass(&cancel("1")).unwrap().forwarded.is_none());
        assert!(early_token.is_cancelled());
        assert!(!session.sending(&early, &minter.mint()));
        // Sent: the cancellation reaches the upstream under the proxy's id.
        let (sent, token) = session.guard(&json("\"two\"")).unwrap();
        let proxy_id = minter.mint();
        assert!(session.sending(&sent, &proxy_id));
        let forwarded = session.pass(&cancel("\"two\"")).unwrap().forwarded.unwrap();
        assert_eq!(
            forwarded.get("params").unwrap().get("requestId"),
            Some(&Json::String(proxy_id))
        );
        assert!(token.is_cancelled());
        // A cancellation of anything else passes as it came; the id stays refused among the
        // latest cancelled ones, which are bounded.
        session.pass(&ping(9)).unwrap();
        let other = session.pass(&cancel("9")).unwrap().forwarded.unwrap();
        assert_eq!(other, cancel("9"));
        assert!(session.pass(&ping(9)).is_err());
        for n in 100..100 + MAX_CANCELLED {
            session.pass(&ping(n)).unwrap();
            session.pass(&cancel(&n.to_string())).unwrap();
        }
        session.pass(&ping(9)).unwrap();
    }

    #[test]
    fn a_guarded_request_travels_under_the_proxys_id_and_token() {
        let minter = Minter::new();
        let proxy_id = minter.mint();
        assert!(minter.owns(&proxy_id) && proxy_id.starts_with(RESERVED));
        assert!(!Minter::new().owns(&proxy_id), "each proxy its own prefix");
        let mut request = json(
            r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"t","_meta":{"progressToken":"p-1"}}}"#,
        );
        let token = under_proxy_id(&mut request, &proxy_id);
        assert_eq!(token, Some(Json::String("p-1".into())));
        assert_eq!(request.get("id"), Some(&Json::String(proxy_id.clone())));
        let mut progress = serde_json::json!({"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken": proxy_id,"progress":1}});
        assert!(proxy_progress_token(&minter, &progress).is_some());
        progress_for_client(&mut progress, &token.unwrap());
        assert_eq!(progress["params"]["progressToken"], "p-1");
    }
}
