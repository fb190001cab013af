//! The history's chain: evidence that no one rewrote it.
//!
//! Someone with access to the database could edit an event, a result or a state, and nothing
//! would show it. So each tenant's history is chained: a replica links the tenant's events, in
//! sequence order, once no event below them can still commit (the watch's watermark), into
//! *links*. A link lists, for each of its events, a digest of the event as recorded (every
//! column, and for an event after which the operation is CONFIRMED, a digest of its result and
//! provider reference), and carries the hash of the link before it: changing, removing or
//! adding an event, or a result, breaks the link's entries, and rewriting a link breaks the
//! hash of every link after it.
//!
//! Linking after the commit keeps the chain off the path of every call: no write waits for
//! another tenant's, or for its own tenant's chain; one replica at a time links a range of
//! sequences (a conditional write of the progress), for every tenant at once.
//!
//! Retention deletes events by age, and links once every event they list is gone: the oldest
//! link kept is the chain's anchor, its `previous` taken on trust. An event a link lists may be
//! missing only when retention can have deleted it (its sequence is at or below the highest one
//! retention deleted).

use std::fmt;

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::jcs;

/// An event as the database records it: every column, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub sequence: i64,
    pub tenant: String,
    pub operation_id: String,
    pub life: i64,
    pub at: i64,
    pub kind: String,
    pub from_state: Option<String>,
    pub to_state: Option<String>,
    /// The operation's state once the event was recorded.
    pub state: Option<String>,
    pub tool: Option<String>,
    pub attempt: Option<i64>,
    pub actor: String,
    pub reason: Option<String>,
    pub details: Option<String>,
    pub dedupe_key: Option<String>,
}

impl Recorded {
    /// Whether the operation was CONFIRMED once the event was recorded: its result is chained
    /// with it.
    pub fn confirmed(&self) -> bool {
        self.state.as_deref() == Some("CONFIRMED")
    }
}

/// An operation's stored result and provider reference.
pub type StoredResult = (Vec<u8>, Option<String>);

/// An event as stored, with its operation's result where [`entry`] takes one.
pub type Stored = (Recorded, Option<StoredResult>);

/// The first 16 bytes of SHA-256, in hex: what an entry keeps of a digest.
fn short(bytes: &[u8]) -> String {
    hex::encode(&Sha256::digest(bytes)[..16])
}

/// The digest of a stored result and its provider reference.
pub fn result_digest(result: &[u8], provider_ref: Option<&str>) -> String {
    let mut text = hex::encode(result);
    text.push('\n');
    text.push_str(provider_ref.unwrap_or(""));
    short(text.as_bytes())
}

/// The digest of an event as recorded, with its result's digest (see [`result_digest`]) when
/// the operation was CONFIRMED after it: the canonical JSON of every column, hashed.
pub fn event_digest(event: &Recorded, result: Option<&str>) -> String {
    let value = json!({
        "sequence": event.sequence,
        "tenant": event.tenant,
        "operation_id": event.operation_id,
        "life": event.life,
        "at": event.at,
        "kind": event.kind,
        "from_state": event.from_state,
        "to_state": event.to_state,
        "state": event.state,
        "tool": event.tool,
        "attempt": event.attempt,
        "actor": event.actor,
        "reason": event.reason,
        "details": event.details,
        "dedupe_key": event.dedupe_key,
        "result": result,
    });
    short(jcs::canonicalize(&value).as_bytes())
}

/// What a link keeps of one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub sequence: i64,
    pub digest: String,
    /// The digest of the result, for an event after which the operation was CONFIRMED.
    pub result: Option<String>,
}

/// A link's entries as stored: `sequence:digest:result` (`-` for none), comma-separated.
pub fn encode_entries(entries: &[Entry]) -> String {
    entries
        .iter()
        .map(|e| {
            format!(
                "{}:{}:{}",
                e.sequence,
                e.digest,
                e.result.as_deref().unwrap_or("-")
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Reads entries as [`encode_entries`] writes them; `None` when they are not so written.
pub fn decode_entries(text: &str) -> Option<Vec<Entry>> {
    if text.is_empty() {
        return Some(Vec::new());
    }
    text.split(',')
        .map(|entry| {
            let mut parts = entry.split(':');
            let sequence = parts.next()?.parse().ok()?;
            let digest = parts.next()?.to_owned();
            let result = match parts.next()? {
                "-" => None,
                result => Some(result.to_owned()),
            };
            parts.next().is_none().then_some(Entry {
                sequence,
                digest,
                result,
            })
        })
        .collect()
}

/// One link of a tenant's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub tenant: String,
    /// 1, 2, … in the tenant's chain.
    pub number: i64,
    /// The sequence after which it starts: the link before's `through` (0 for the first).
    pub after: i64,
    /// The last sequence it covers: every event of the tenant in `(after, through]` is listed.
    pub through: i64,
    /// [`encode_entries`].
    pub entries: String,
    /// The hash of the link before (empty for the first).
    pub previous: String,
    pub hash: String,
    /// When it was written, by the store's clock.
    pub at: i64,
}

/// A verification of one tenant's chain, as recorded (the latest of each tenant is kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verification {
    pub tenant: String,
    /// When, by the store's clock.
    pub at: i64,
    /// The last sequence the chain covered then.
    pub through: i64,
    pub links: i64,
    pub events: i64,
    /// The first problem found, as said to people; `None` when everything matched.
    pub problem: Option<String>,
}

/// The hash of a link: SHA-256 over what it says, and the hash before it.
pub fn link_hash(
    tenant: &str,
    (number, after, through): (i64, i64, i64),
    entries: &str,
    previous: &str,
) -> String {
    let text =
        format!("once-chain-v1\n{tenant}\n{number}\n{after}\n{through}\n{entries}\n{previous}");
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// The link after `before` (none for a tenant's first) listing `entries`, through `through`.
pub fn next_link(
    tenant: &str,
    before: Option<&Link>,
    entries: &[Entry],
    through: i64,
    at: i64,
) -> Link {
    let (number, after, previous) = before.map_or((1, 0, String::new()), |b| {
        (b.number + 1, b.through, b.hash.clone())
    });
    let entries = encode_entries(entries);
    let hash = link_hash(tenant, (number, after, through), &entries, &previous);
    Link {
        tenant: tenant.to_owned(),
        number,
        after,
        through,
        entries,
        previous,
        hash,
        at,
    }
}

/// The entry an event makes, with its operation's result now (`result`, for an event after
/// which the operation is CONFIRMED and the row of that life is still stored).
pub fn entry(event: &Recorded, result: Option<(&[u8], Option<&str>)>) -> Entry {
    let result = event
        .confirmed()
        .then_some(result)
        .flatten()
        .map(|(bytes, provider_ref)| result_digest(bytes, provider_ref));
    Entry {
        sequence: event.sequence,
        digest: event_digest(event, result.as_deref()),
        result,
    }
}

/// What does not match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// The link is not the one its hash says, or does not follow the one before.
    Link { number: i64, why: &'static str },
    /// An event differs from the one the chain recorded.
    Changed { sequence: i64, operation_id: String },
    /// An event the chain recorded is gone, and retention cannot have deleted it.
    Missing { sequence: i64 },
    /// An event is stored that the chain did not record.
    Added { sequence: i64, operation_id: String },
    /// An operation's stored result is not the one its CONFIRMED event recorded.
    Result { sequence: i64, operation_id: String },
    /// An operation's state is not the one its latest event recorded.
    State {
        sequence: i64,
        operation_id: String,
        stored: String,
        recorded: String,
    },
}

impl Problem {
    /// The sequence of the first event it is about (the link's first for a broken link).
    pub fn sequence(&self) -> Option<i64> {
        match self {
            Problem::Link { .. } => None,
            Problem::Changed { sequence, .. }
            | Problem::Missing { sequence }
            | Problem::Added { sequence, .. }
            | Problem::Result { sequence, .. }
            | Problem::State { sequence, .. } => Some(*sequence),
        }
    }

    /// A short code for programs.
    pub fn code(&self) -> &'static str {
        match self {
            Problem::Link { .. } => "LINK",
            Problem::Changed { .. } => "EVENT_CHANGED",
            Problem::Missing { .. } => "EVENT_MISSING",
            Problem::Added { .. } => "EVENT_ADDED",
            Problem::Result { .. } => "RESULT_CHANGED",
            Problem::State { .. } => "STATE_CHANGED",
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Link { number, why } => write!(f, "link {number} {why}"),
            Problem::Changed {
                sequence,
                operation_id,
            } => write!(
                f,
                "event {sequence} (operation {operation_id}) is not the event the chain recorded"
            ),
            Problem::Missing { sequence } => write!(
                f,
                "event {sequence} is gone, and retention had not deleted that far"
            ),
            Problem::Added {
                sequence,
                operation_id,
            } => write!(
                f,
                "event {sequence} (operation {operation_id}) is not one the chain recorded"
            ),
            Problem::Result {
                sequence,
                operation_id,
            } => write!(
                f,
                "operation {operation_id}'s result is not the one its event {sequence} recorded"
            ),
            Problem::State {
                sequence,
                operation_id,
                stored,
                recorded,
            } => write!(
                f,
                "operation {operation_id} is {stored}, but its latest event ({sequence}) left it {recorded}"
            ),
        }
    }
}

/// A verification of one tenant's chain: what was checked, and the first problem found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub tenant: String,
    pub links: i64,
    pub events: i64,
    /// The last sequence the chain covered.
    pub through: i64,
    /// The newest link's number and hash.
    pub head: Option<(i64, String)>,
    /// When, by the store's clock.
    pub at: i64,
    pub problem: Option<Problem>,
}

/// Checks one link against the link before it (none for the oldest kept, whose `previous` is
/// the anchor) and the tenant's events stored in its range, oldest first, each with its
/// operation's result now where [`entry`] takes one; `deleted_through` is the highest sequence
/// retention deleted. The first problem, in sequence order.
pub fn check_link(
    link: &Link,
    before: Option<&Link>,
    events: &[Stored],
    deleted_through: i64,
) -> Result<usize, Problem> {
    let broken = |why| Problem::Link {
        number: link.number,
        why,
    };
    let hash = link_hash(
        &link.tenant,
        (link.number, link.after, link.through),
        &link.entries,
        &link.previous,
    );
    if hash != link.hash {
        return Err(broken("is not what its hash says"));
    }
    if let Some(before) = before {
        if before.number + 1 != link.number
            || before.through != link.after
            || before.hash != link.previous
        {
            return Err(broken("does not follow the link before it"));
        }
    }
    let entries = decode_entries(&link.entries).ok_or(broken("has entries that cannot be read"))?;
    let mut stored = events.iter().peekable();
    for recorded in &entries {
        // Events stored before this entry that the chain did not record.
        if let Some((event, _)) = stored.next_if(|(e, _)| e.sequence < recorded.sequence) {
            return Err(Problem::Added {
                sequence: event.sequence,
                operation_id: event.operation_id.clone(),
            });
        }
        match stored.next_if(|(e, _)| e.sequence == recorded.sequence) {
            None if recorded.sequence <= deleted_through => {}
            None => {
                return Err(Problem::Missing {
                    sequence: recorded.sequence,
                })
            }
            Some((event, result)) => {
                // The event as recorded, with the result digest the chain kept: its columns.
                if event_digest(event, recorded.result.as_deref()) != recorded.digest {
                    return Err(Problem::Changed {
                        sequence: event.sequence,
                        operation_id: event.operation_id.clone(),
                    });
                }
                // The result stored now, where the operation of that life still is.
                let now = result
                    .as_ref()
                    .filter(|_| event.confirmed())
                    .map(|(bytes, provider_ref)| result_digest(bytes, provider_ref.as_deref()));
                if let (Some(now), Some(then)) = (now, &recorded.result) {
                    if &now != then {
                        return Err(Problem::Result {
                            sequence: event.sequence,
                            operation_id: event.operation_id.clone(),
                        });
                    }
                }
            }
        }
    }
    if let Some((event, _)) = stored.next() {
        return Err(Problem::Added {
            sequence: event.sequence,
            operation_id: event.operation_id.clone(),
        });
    }
    Ok(entries.len())
}

#[cfg(test)]
#[path = "chain_tests.rs"]
mod tests;
