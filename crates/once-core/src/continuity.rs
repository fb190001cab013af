//! Continuity: a ledger restored to an earlier state must not execute again what it forgot.
//!
//! After a restore from a backup, or the promotion of a standby that lagged, the operations
//! that ran after the copy are gone from the ledger: their ids look new, and the next Begin of
//! one would execute it a second time. No lease or fencing token can see that; only a client
//! that saw the later state can. So with every execution right the ledger hands the client a
//! [`Position`]: a statement, sealed with a key kept in the ledger's own database, that this
//! operation of this tenant was granted this attempt and fencing token, in this epoch of this
//! ledger. The client keeps the highest it saw and sends it with every Begin.
//!
//! A ledger shown a position it cannot account for is behind ([`check`], [`after_lookup`]):
//! the position's epoch is later than the tenant's, or its token is above every token the
//! ledger has issued, or the ledger has issued tokens past it since but the claim it records is
//! not in the ledger's history although retention cannot have deleted it (the restored ledger
//! moved on over what it lost). The tenant's executions are then held: a Begin that would start
//! one is answered [`crate::BeginDecision::Held`], while replays, reads and reports go on,
//! until an operator accepts the loss, which opens the tenant's next epoch. A client refused so
//! reports the positions it kept, and each operation the ledger lacks comes back UNKNOWN
//! ([`recover`]) for the reconcilers, never as new.
//!
//! The seal proves the ledger issued the position, so no caller holds a tenant by inventing
//! one; the key travels with the database, so a restored ledger still knows its own positions.

use std::fmt;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde_json::{json, Map, Value};
use sha2::Sha256;

use crate::machine::{moved, Plan, Write};
use crate::{
    Actor, Attempt, AttemptContext, EventKind, FencingToken, Fingerprint, Holder, Invalid, Millis,
    NewEvent, Operation, OperationId, Source, State,
};

/// The request field a client sends its highest position in.
pub const FIELD: &str = "seen_position";

/// The request field a client sends its latest position of the operation it begins in.
pub const OPERATION_FIELD: &str = "operation_position";

/// What a sealed position starts with: the version of its encoding.
const PREFIX: &str = "p1.";

/// How many bytes of the HMAC-SHA-256 a sealed position carries.
const TAG_BYTES: usize = 16;

/// The longest sealed position accepted: a position names an operation id, a tool, a provider,
/// a provider key and lookup hints (up to 4 KiB, which JSON escaping may double), each bounded
/// by the request limits, and base64 makes four bytes of three. No position the ledger seals
/// is longer.
pub const MAX_SEALED: usize = 16 * 1024;

/// One execution right as the ledger granted it, for the client to remember.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// The ledger's identity: positions of another ledger prove nothing about this one.
    pub ledger: String,
    /// The tenant's epoch when it was granted (see the module documentation).
    pub epoch: u64,
    pub tenant: String,
    pub operation_id: OperationId,
    pub tool: String,
    pub fingerprint: Fingerprint,
    pub life: FencingToken,
    pub attempt: u32,
    pub token: FencingToken,
    pub provider: Option<String>,
    pub provider_key: String,
    /// The reconciler's hints (JSON text): a lost operation comes back with them, so its
    /// reconciler can look it up.
    pub lookup_hints: Option<String>,
    /// How long the operation is kept once settled.
    pub retention_ms: i64,
    /// When it was granted, by the store's clock.
    pub at: Millis,
}

/// Seals positions with the ledger's key and opens the ones clients send back.
#[derive(Clone)]
pub struct Seal {
    ledger: String,
    key: [u8; 32],
}

impl fmt::Debug for Seal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Seal")
            .field("ledger", &self.ledger)
            .field("key", &"<redacted>")
            .finish()
    }
}

/// A sealed position, opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    /// This ledger's, and its seal holds.
    Ours(Box<Position>),
    /// Another ledger's (the client was pointed elsewhere, or this database was replaced by a
    /// new one): it proves nothing here.
    Elsewhere { ledger: String },
}

impl Seal {
    pub fn new(ledger: impl Into<String>, key: [u8; 32]) -> Self {
        Self {
            ledger: ledger.into(),
            key,
        }
    }

    /// The ledger's identity.
    pub fn ledger(&self) -> &str {
        &self.ledger
    }

    fn mac(&self) -> Hmac<Sha256> {
        Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes a key of any length")
    }

    /// The position as text a client keeps and sends back: `p1.<payload>.<tag>`.
    pub fn seal(&self, position: &Position) -> String {
        let payload = URL_SAFE_NO_PAD.encode(encode(position).to_string());
        let signed = format!("{PREFIX}{payload}");
        let mut mac = self.mac();
        mac.update(signed.as_bytes());
        let tag = mac.finalize().into_bytes();
        format!("{signed}.{}", URL_SAFE_NO_PAD.encode(&tag[..TAG_BYTES]))
    }

    /// Opens a position a client sent: refused unless it is well formed and, when it names this
    /// ledger, sealed with this ledger's key.
    pub fn open(&self, text: &str) -> Result<Opened, Invalid> {
        self.open_field(FIELD, text)
    }

    /// [`Seal::open`], naming `field` when it refuses.
    pub fn open_field(&self, field: &str, text: &str) -> Result<Opened, Invalid> {
        let refuse = |why: &str| Invalid::new(field, why.to_owned());
        if text.len() > MAX_SEALED {
            return Err(refuse("is longer than any position the ledger issues"));
        }
        let body = text
            .strip_prefix(PREFIX)
            .ok_or_else(|| refuse("is not a position this ledger issues (p1.…)"))?;
        let (payload, tag) = body.split_once('.').ok_or_else(|| refuse("has no seal"))?;
        let json = URL_SAFE_NO_PAD
            .decode(payload)
            .ok()
            .and_then(|bytes| String::from_utf8(bytes).ok())
            .ok_or_else(|| refuse("is not a position this ledger issues"))?;
        let position = decode(&json).map_err(|why| refuse(&why))?;
        if position.ledger != self.ledger {
            return Ok(Opened::Elsewhere {
                ledger: position.ledger,
            });
        }
        let tag = URL_SAFE_NO_PAD
            .decode(tag)
            .map_err(|_| refuse("has a seal that is not base64url"))?;
        let mut mac = self.mac();
        mac.update(&text.as_bytes()[..PREFIX.len() + payload.len()]);
        mac.verify_truncated_left(&tag)
            .ok()
            .filter(|()| tag.len() == TAG_BYTES)
            .ok_or_else(|| refuse("was not sealed by this ledger"))?;
        Ok(Opened::Ours(Box::new(position)))
    }
}

/// What a sealed position says, read without its seal: only the ledger that sealed it can
/// check that. For the client's bookkeeping (which is its highest, which ledger it is of);
/// proof of nothing.
pub fn peek(text: &str) -> Result<Position, Invalid> {
    let refuse = |why: &str| Invalid::new(FIELD, why.to_owned());
    let payload = text
        .strip_prefix(PREFIX)
        .and_then(|body| body.split_once('.'))
        .map(|(payload, _)| payload)
        .ok_or_else(|| refuse("is not a position a ledger issues (p1.…)"))?;
    let json = URL_SAFE_NO_PAD
        .decode(payload)
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .ok_or_else(|| refuse("is not a position a ledger issues"))?;
    decode(&json).map_err(|why| refuse(&why))
}

fn encode(p: &Position) -> Value {
    json!({
        "ledger": p.ledger,
        "epoch": p.epoch,
        "tenant": p.tenant,
        "operation_id": p.operation_id.as_str(),
        "tool": p.tool,
        "fingerprint": p.fingerprint.to_hex(),
        "life": p.life.get(),
        "attempt": p.attempt,
        "token": p.token.get(),
        "provider": p.provider,
        "provider_key": p.provider_key,
        "lookup_hints": p.lookup_hints,
        "retention_ms": p.retention_ms,
        "at": p.at,
    })
}

fn decode(json: &str) -> Result<Position, String> {
    let value: Value = serde_json::from_str(json).map_err(|_| "is not a position".to_owned())?;
    let Value::Object(fields) = value else {
        return Err("is not a position".into());
    };
    const NAMES: [&str; 14] = [
        "ledger",
        "epoch",
        "tenant",
        "operation_id",
        "tool",
        "fingerprint",
        "life",
        "attempt",
        "token",
        "provider",
        "provider_key",
        "lookup_hints",
        "retention_ms",
        "at",
    ];
    if let Some(name) = fields.keys().find(|name| !NAMES.contains(&name.as_str())) {
        return Err(format!("has a field no position has: {name}"));
    }
    let text = |name: &str| -> Result<String, String> {
        fields
            .get(name)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| format!("has no text {name}"))
    };
    let number = |name: &str| -> Result<u64, String> {
        fields
            .get(name)
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("has no number {name}"))
    };
    let signed = |name: &str| -> Result<i64, String> {
        fields
            .get(name)
            .and_then(Value::as_i64)
            .ok_or_else(|| format!("has no number {name}"))
    };
    let text_or_null = |name: &str| -> Result<Option<String>, String> {
        match fields.get(name) {
            Some(Value::Null) => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            _ => Err(format!("has no {name} (text or null)")),
        }
    };
    let provider = text_or_null("provider")?;
    let lookup_hints = text_or_null("lookup_hints")?;
    Ok(Position {
        ledger: text("ledger")?,
        epoch: number("epoch")?,
        tenant: text("tenant")?,
        operation_id: OperationId::parse("operation_id", &text("operation_id")?)
            .map_err(|e| e.to_string())?,
        tool: text("tool")?,
        fingerprint: Fingerprint::parse_hex("fingerprint", &text("fingerprint")?)
            .map_err(|e| e.to_string())?,
        life: FencingToken(number("life")?),
        attempt: u32::try_from(number("attempt")?).map_err(|_| "has no attempt".to_owned())?,
        token: FencingToken(number("token")?),
        provider,
        provider_key: text("provider_key")?,
        lookup_hints,
        retention_ms: signed("retention_ms")?,
        at: signed("at")?,
    })
}

/// Why a ledger is behind what a client saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The client saw a later epoch of the tenant: the ledger was restored to before an
    /// operator accepted an earlier loss.
    EpochAhead,
    /// The client saw a fencing token the ledger has not issued yet.
    TokenAhead,
    /// The ledger issued tokens past the client's since, but has no record of the claim the
    /// client saw, which retention cannot have deleted: it moved on over what it lost.
    ClaimMissing,
}

impl Why {
    pub fn as_str(self) -> &'static str {
        match self {
            Why::EpochAhead => "EPOCH_AHEAD",
            Why::TokenAhead => "TOKEN_AHEAD",
            Why::ClaimMissing => "CLAIM_MISSING",
        }
    }

    pub fn parse(text: &str) -> Option<Why> {
        [Why::EpochAhead, Why::TokenAhead, Why::ClaimMissing]
            .into_iter()
            .find(|why| why.as_str() == text)
    }
}

/// A ledger found behind a client: what the client saw and what the ledger holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Behind {
    pub why: Why,
    /// The epoch and fencing token the client saw, and the operation they were granted to.
    pub client_epoch: u64,
    pub client_token: FencingToken,
    pub operation_id: OperationId,
    /// The tenant's epoch and the highest token the ledger had issued when it was found.
    pub ledger_epoch: u64,
    pub ledger_token: FencingToken,
}

impl fmt::Display for Behind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.why {
            Why::EpochAhead => write!(
                f,
                "a client saw epoch {} of this tenant, and the ledger is at epoch {}",
                self.client_epoch, self.ledger_epoch
            ),
            Why::TokenAhead => write!(
                f,
                "a client saw fencing token {} (operation {}), and the ledger has issued tokens only through {}",
                self.client_token, self.operation_id, self.ledger_token
            ),
            Why::ClaimMissing => write!(
                f,
                "a client saw fencing token {} granted to operation {}, and the ledger (through token {}) has no record of that claim",
                self.client_token, self.operation_id, self.ledger_token
            ),
        }
    }
}

/// Where a tenant stands: its epoch, and whether its executions are held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Standing {
    pub tenant: String,
    /// Opened by each accepted loss: positions of earlier epochs prove nothing any more.
    pub epoch: u64,
    pub held: Option<Held>,
}

/// Executions held since a client showed the ledger behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// When, by the store's clock.
    pub since: Millis,
    pub behind: Behind,
}

/// An operator accepted a tenant's loss: its executions go on, in a new epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub tenant: String,
    /// The epoch it opened.
    pub epoch: u64,
    /// When, by the store's clock, and by whom and why.
    pub at: Millis,
    pub actor: Actor,
    pub reason: String,
    /// What was held, when it was.
    pub held: Option<Held>,
}

/// What a position shows before the claim it records is looked up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// Nothing the ledger lacks (a token whose claim was found before).
    Fine,
    Behind(Behind),
    /// The ledger has issued tokens past it, or it is of an earlier epoch: look its claim up
    /// ([`after_lookup`]). A claim of an earlier epoch the ledger lacks is one a client that
    /// did not report before the loss was accepted still holds: that client's Begin is
    /// refused until it reports, and the tenant is not held again.
    LookUp,
}

/// Judges `position` against the tenant's `epoch` and the highest token the ledger has issued.
pub fn check(position: &Position, epoch: u64, issued_through: FencingToken) -> Check {
    let behind = |why| {
        Check::Behind(Behind {
            why,
            client_epoch: position.epoch,
            client_token: position.token,
            operation_id: position.operation_id.clone(),
            ledger_epoch: epoch,
            ledger_token: issued_through,
        })
    };
    if position.epoch > epoch {
        behind(Why::EpochAhead)
    } else if position.epoch == epoch && position.token > issued_through {
        behind(Why::TokenAhead)
    } else {
        Check::LookUp
    }
}

/// Judges `position` once its claim was looked up in the ledger's history: `found` or not, at
/// `now`, where retention deletes events `events_kept_ms` after they were written (a claim
/// older than that may be gone with them, and proves nothing either way).
pub fn after_lookup(
    position: &Position,
    found: bool,
    (epoch, issued_through): (u64, FencingToken),
    now: Millis,
    events_kept_ms: i64,
) -> Option<Behind> {
    let may_be_deleted = position.at <= now.saturating_sub(events_kept_ms);
    (!found && !may_be_deleted).then(|| Behind {
        why: Why::ClaimMissing,
        client_epoch: position.epoch,
        client_token: position.token,
        operation_id: position.operation_id.clone(),
        ledger_epoch: epoch,
        ledger_token: issued_through,
    })
}

/// A CONFIRMED operation never changes, but a later attempt of its life the ledger lost may
/// also have performed the effect: that is recorded, once, as the anomaly it is.
fn lost_after_confirmed(op: &Operation, position: &Position) -> Plan {
    lost_anomaly(
        op,
        position,
        "granted after the attempt whose effect is confirmed; it may have performed the effect too",
    )
}

/// The ledger lost an attempt and has granted a later one since (of this life or a new one,
/// to a client that never saw the lost one): both may have performed the effect. Recorded,
/// once; nothing else changes.
fn lost_before_a_later_attempt(op: &Operation, position: &Position) -> Plan {
    lost_anomaly(
        op,
        position,
        &format!(
            "lost, and the ledger has granted attempt {} (fencing token {}) since: both may have performed the effect",
            op.attempt, op.fencing_token
        ),
    )
}

fn lost_anomaly(op: &Operation, position: &Position, what: &str) -> Plan {
    let event = NewEvent::anomaly(
        op,
        EventKind::DoubleExecution,
        position.attempt,
        Actor::Ledger,
        format!("restored:{}", position.token),
    )
    .because(format!(
        "the ledger was restored to an earlier state: a client saw attempt {} (fencing token {}) granted, {what}",
        position.attempt, position.token
    ));
    Plan {
        events: vec![event],
        ..Plan::default()
    }
}

/// Whether the attempt `position` records was lost by the ledger, from whether its history
/// records it (its claim, or its recovery) at `now`: not recorded, and recent enough that
/// retention cannot have deleted the record. Only such an attempt is brought back by
/// [`recover`]; one the history records is known to this ledger, whatever has become of its
/// operation since (settled, and deleted by retention).
pub fn lost(position: &Position, recorded: bool, now: Millis, events_kept_ms: i64) -> bool {
    !recorded && position.at > now.saturating_sub(events_kept_ms)
}

/// The writes that bring back an operation a client saw and the ledger lost: `stored` as the
/// ledger holds it (if at all), `position` as the client reports it (and whether the history
/// records any event of its life), by `reporter`. The
/// operation becomes UNKNOWN with the attempt the client saw, so no Begin executes it again and
/// a reconciler looks its effect up (by the provider key the client was given); a late report
/// from that attempt's credential settles it as any attempt's would. `None` when the ledger
/// already knows that attempt, or a later one, or holds the operation CONFIRMED: nothing is
/// lost there.
pub fn recover(
    stored: Option<&Operation>,
    (position, life_recorded): (&Position, bool),
    (actor, reporter): (&Actor, &Holder),
    now: Millis,
) -> Option<Plan> {
    // The life the client saw, as stored (past its retention or not: its outcome is still the
    // one recorded); or a live row of another life.
    let same_life = stored.filter(|op| op.life == position.life);
    // A life the history records but no row holds any more settled, and retention deleted it:
    // its idempotency window is over, as it would be had the ledger never been restored.
    if same_life.is_none() && life_recorded {
        return None;
    }
    match stored {
        Some(op) if op.fencing_token == position.token => return None,
        // The ledger granted a later attempt (perhaps a new life) since it lost this one: both
        // may have performed the effect.
        Some(op) if op.fencing_token > position.token => {
            return Some(lost_before_a_later_attempt(op, position))
        }
        _ => {}
    }
    // A later life than the one stored, whatever became of that one (the client saw the life
    // after it begin, so in the lost state it had ended), replaces it below.
    if let Some(op) = same_life.filter(|op| op.state == State::Confirmed) {
        return Some(lost_after_confirmed(op, position));
    }
    // A new life under the provider key of the life stored took it over when that life ended
    // ABSENT (after the copy the ledger was restored from, perhaps): it keeps that life's
    // attempts beside its own, as a claim of it does (see `machine::claim`), so a late confirm
    // of one of them is judged, not refused.
    let inherits =
        same_life.is_none() && stored.is_some_and(|op| op.provider_key == position.provider_key);
    let reason = format!(
        "the ledger was restored to an earlier state: a client saw attempt {} (fencing token {}) granted, which the ledger had lost; look the effect up by its provider key",
        position.attempt, position.token
    );
    let base = match same_life {
        Some(op) => op.clone(),
        None => Operation {
            tenant: position.tenant.clone(),
            operation_id: position.operation_id.clone(),
            tool: position.tool.clone(),
            fingerprint: position.fingerprint,
            state: State::Absent,
            source: Source::Continuity,
            attempt: position.attempt,
            fencing_token: position.token,
            life: position.life,
            attempt_id: String::new(),
            attempt_context: AttemptContext::default(),
            executor: actor.clone(),
            holder: None,
            lease_started_at: position.at,
            lease_deadline: position.at,
            result: None,
            provider_ref: None,
            provider_key: position.provider_key.clone(),
            provider: position.provider.clone(),
            lookup_hints: position.lookup_hints.clone(),
            retention_ms: position.retention_ms,
            created_at: position.at,
            updated_at: position.at,
            expires_at: None,
            reason: None,
            version: stored.map_or(0, |op| op.version),
            unknown_since: None,
            last_report_at: None,
            declared_absent_token: stored
                .filter(|_| inherits)
                .and_then(|op| op.declared_absent_token),
            confirmed_by: None,
            reconcile_lookups: 0,
            reconcile_next_at: None,
            lookup_claimed_until: None,
        },
    };
    // The move the event records: from the row as it was, unless a new life replaces one
    // whose attempts it forgets (a new life begins from ABSENT, as a claim's does).
    let from = match (same_life, stored) {
        (Some(op), _) => op.state,
        (None, Some(op)) if inherits => op.state,
        _ => State::Absent,
    };
    let mut lost = base;
    lost.attempt = position.attempt;
    lost.fencing_token = position.token;
    lost.attempt_id = String::new();
    lost.attempt_context = AttemptContext::default();
    lost.executor = actor.clone();
    lost.holder = reporter.clone();
    lost.lease_started_at = position.at;
    lost.lease_deadline = position.at;
    if lost.provider.is_none() {
        lost.provider = position.provider.clone();
    }
    if lost.lookup_hints.is_none() {
        lost.lookup_hints = position.lookup_hints.clone();
    }
    // The attempt the ledger held open (IN_FLIGHT, or UNKNOWN) ended unrecorded before the one
    // the client saw was granted: for all the ledger knows it performed the effect, so it
    // counts as declared ABSENT by someone other than itself, and a late confirm of an earlier
    // attempt is judged as one that may be a second effect (see `machine::report`).
    let kept_key = same_life.is_some() || inherits;
    if let Some(open) =
        stored.filter(|op| kept_key && matches!(op.state, State::InFlight | State::Unknown))
    {
        lost.declared_absent_token = Some(open.fencing_token);
    }
    // An effect already proven in this life (a superseded attempt's confirm, or a reconciler's
    // finding, while a later attempt may also have run) stays proven: the operation stays held
    // for an operator with that effect's result, and the attempt brought back is its latest.
    let proof = same_life.filter(|op| op.held_for_operator());
    let mut next = match proof {
        Some(held) => {
            let mut next = moved(&lost, State::Unknown, Source::Anomaly, now);
            next.confirmed_by = held.confirmed_by;
            next
        }
        None => moved(&lost, State::Unknown, Source::Continuity, now),
    };
    // The reason it was held for stays, after this restore's (once: not one per restore).
    const HELD: &str = ". Held for an operator: ";
    next.reason = Some(match proof.and_then(|held| held.reason.as_deref()) {
        Some(held) => {
            let why = held.split_once(HELD).map_or(held, |(_, why)| why);
            format!("{reason}{HELD}{why}")
        }
        None => reason.clone(),
    });
    let event = NewEvent::transition(
        &next,
        EventKind::Recovered,
        (from, State::Unknown),
        position.attempt,
        Actor::Ledger,
    )
    .because(reason)
    .with_details(Value::Object(Map::from_iter([
        ("fencing_token".into(), position.token.get().into()),
        ("granted_at".into(), position.at.into()),
        ("epoch".into(), position.epoch.into()),
    ])));
    let attempt = Attempt {
        number: position.attempt,
        fencing_token: position.token,
        life: position.life,
        attempt_id: String::new(),
        started_at: position.at,
        lease_deadline: position.at,
        actor: actor.clone(),
        holder: reporter.clone(),
        context: AttemptContext::default(),
    };
    let write = if stored.is_some() {
        Write::Update(next)
    } else {
        Write::Insert(next)
    };
    Some(Plan {
        operation: Some(write),
        attempt: Some(attempt),
        forgets_attempts: stored.is_some() && same_life.is_none() && !inherits,
        events: vec![event],
    })
}

#[cfg(test)]
#[path = "continuity_tests.rs"]
mod tests;
