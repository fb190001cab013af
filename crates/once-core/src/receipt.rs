//! Signed receipts: what the ledger recorded of a settled operation, signed with the ledger's
//! Ed25519 key, so that whoever holds one can prove it later to anyone who has the public key.
//!
//! A receipt is text, `r1.<payload>.<signature>`: the payload is the receipt's JSON in
//! base64url (no padding), and the signature is Ed25519 over the ASCII bytes of `r1.<payload>`,
//! also in base64url. Verifying needs only that and the public key; the payload names the key
//! that signed it (`key`, the first 16 hex digits of the SHA-256 of the public key), so a
//! verifier holding several keys (a rotation keeps the old ones) knows which to use. See
//! docs/evidence.md for the fields.
//!
//! The key never reaches the database: someone who can write the database can rewrite its
//! history (the chain shows where) but cannot make a receipt.

use std::fmt;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ed25519_dalek::Signer as _;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::{Millis, State};

const PREFIX: &str = "r1.";
/// No receipt the ledger signs is longer: its fields are bounded by the ledger's limits.
pub const MAX_RECEIPT: usize = 16 * 1024;
const SIGNATURE_BYTES: usize = 64;

/// What a receipt says. It is true of the operation's life as the ledger recorded it when the
/// operation settled (`settled_at`): CONFIRMED with the result whose SHA-256 it carries, or
/// ABSENT for the attempt it names (an ABSENT operation may be executed again later, as a new
/// attempt with a later fencing token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    /// The ledger's identity (`ledger_identity`), as in its positions.
    pub ledger: String,
    /// The signing key's id.
    pub key: String,
    pub tenant: String,
    pub operation_id: String,
    pub tool: String,
    pub life: u64,
    /// CONFIRMED or ABSENT.
    pub state: State,
    /// Who settled it: `attempt` (the executor's own report), `reconciler`, `operator`, …
    /// (`once_core::Source`). An ABSENT that a reconciler or an operator declared is their
    /// judgement: a late confirm of that attempt contradicts it, and the operation moves on.
    pub source: String,
    /// The life's latest attempt when it settled, and its fencing token.
    pub attempt: u32,
    pub fencing_token: u64,
    /// The fencing token of the attempt whose confirm proved the effect, when it is not the
    /// latest one's (a superseded attempt's late confirm).
    pub confirmed_by: Option<u64>,
    /// The SHA-256 of the stored result, byte for byte, in hex; none for an ABSENT operation.
    pub result_sha256: Option<String>,
    pub provider_ref: Option<String>,
    /// The event that settled it, in the tenant's chained history (`oncectl verify`).
    pub sequence: i64,
    pub settled_at: Millis,
    pub issued_at: Millis,
}

/// Why a receipt was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("this is not a receipt a ledger signs: {0}")]
    Malformed(String),
    #[error("it was signed by key {0}, which is not among the public keys given")]
    UnknownKey(String),
    #[error("its signature does not match its content under key {0}: it was changed, or not signed by that key")]
    BadSignature(String),
}

impl Receipt {
    /// Signs the receipt with `key`, naming it.
    pub fn sign(mut self, key: &SigningKey) -> String {
        self.key = key.id.clone();
        let signed = format!(
            "{PREFIX}{}",
            URL_SAFE_NO_PAD.encode(self.encode().to_string())
        );
        let signature = key.secret.sign(signed.as_bytes());
        format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature.to_bytes()))
    }

    /// Opens a receipt and checks its signature under the key it names, which must be among
    /// `keys`.
    pub fn verify(text: &str, keys: &[PublicKey]) -> Result<Receipt, Refused> {
        let (receipt, signed, signature) = split(text)?;
        let key = keys
            .iter()
            .find(|key| key.id == receipt.key)
            .ok_or_else(|| Refused::UnknownKey(receipt.key.clone()))?;
        let signature = ed25519_dalek::Signature::from_bytes(&signature);
        key.key
            .verify_strict(signed.as_bytes(), &signature)
            .map_err(|_| Refused::BadSignature(key.id.clone()))?;
        Ok(receipt)
    }

    /// What a receipt says, read without checking its signature: proof of nothing.
    pub fn unverified(text: &str) -> Result<Receipt, Refused> {
        split(text).map(|(receipt, _, _)| receipt)
    }

    /// Whether `result` is the result this receipt was signed for, byte for byte.
    pub fn covers_result(&self, result: &[u8]) -> bool {
        self.result_sha256.as_deref() == Some(hex::encode(Sha256::digest(result)).as_str())
    }

    fn encode(&self) -> Value {
        json!({
            "ledger": self.ledger,
            "key": self.key,
            "tenant": self.tenant,
            "operation_id": self.operation_id,
            "tool": self.tool,
            "life": self.life,
            "state": self.state.as_str(),
            "source": self.source,
            "attempt": self.attempt,
            "fencing_token": self.fencing_token,
            "confirmed_by": self.confirmed_by,
            "result_sha256": self.result_sha256,
            "provider_ref": self.provider_ref,
            "sequence": self.sequence,
            "settled_at": self.settled_at,
            "issued_at": self.issued_at,
        })
    }
}

/// The SHA-256 of a result, as a receipt carries it.
pub fn result_sha256(result: &[u8]) -> String {
    hex::encode(Sha256::digest(result))
}

fn split(text: &str) -> Result<(Receipt, &str, [u8; SIGNATURE_BYTES]), Refused> {
    let refuse = |why: &str| Refused::Malformed(why.to_owned());
    if text.len() > MAX_RECEIPT {
        return Err(refuse("it is longer than any receipt"));
    }
    let text = text.trim();
    let body = text
        .strip_prefix(PREFIX)
        .ok_or_else(|| refuse("it does not begin r1."))?;
    let (payload, signature) = body
        .split_once('.')
        .ok_or_else(|| refuse("it has no signature"))?;
    let signature: [u8; SIGNATURE_BYTES] = URL_SAFE_NO_PAD
        .decode(signature)
        .ok()
        .and_then(|bytes| bytes.try_into().ok())
        .ok_or_else(|| refuse("its signature is not 64 bytes of base64url"))?;
    let json = URL_SAFE_NO_PAD
        .decode(payload)
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .ok_or_else(|| refuse("its content is not base64url JSON"))?;
    let receipt = decode(&json).map_err(Refused::Malformed)?;
    Ok((receipt, &text[..PREFIX.len() + payload.len()], signature))
}

fn decode(json: &str) -> Result<Receipt, String> {
    const NAMES: [&str; 16] = [
        "ledger",
        "key",
        "tenant",
        "operation_id",
        "tool",
        "life",
        "state",
        "source",
        "attempt",
        "fencing_token",
        "confirmed_by",
        "result_sha256",
        "provider_ref",
        "sequence",
        "settled_at",
        "issued_at",
    ];
    let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(json) else {
        return Err("its content is not a JSON object".into());
    };
    if let Some(name) = fields.keys().find(|name| !NAMES.contains(&name.as_str())) {
        return Err(format!("it has a field no receipt has: {name}"));
    }
    if let Some(name) = NAMES.iter().find(|name| !fields.contains_key(**name)) {
        return Err(format!("it has no {name}"));
    }
    let text = |name: &str| field_text(&fields, name)?.ok_or_else(|| format!("it has no {name}"));
    let number = |name: &str| {
        fields[name]
            .as_u64()
            .ok_or_else(|| format!("its {name} is not a whole number"))
    };
    let signed = |name: &str| {
        fields[name]
            .as_i64()
            .ok_or_else(|| format!("its {name} is not a whole number"))
    };
    let state = match text("state")?.as_str() {
        "CONFIRMED" => State::Confirmed,
        "ABSENT" => State::Absent,
        _ => return Err("its state is neither CONFIRMED nor ABSENT".into()),
    };
    let result_sha256 = field_text(&fields, "result_sha256")?;
    if result_sha256
        .as_deref()
        .is_some_and(|hash| hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        return Err("its result_sha256 is not a SHA-256 in hex".into());
    }
    Ok(Receipt {
        ledger: text("ledger")?,
        key: text("key")?,
        tenant: text("tenant")?,
        operation_id: text("operation_id")?,
        tool: text("tool")?,
        life: number("life")?,
        state,
        source: text("source")?,
        attempt: u32::try_from(number("attempt")?).map_err(|_| "its attempt is too large")?,
        fencing_token: number("fencing_token")?,
        confirmed_by: match &fields["confirmed_by"] {
            Value::Null => None,
            value => Some(
                value
                    .as_u64()
                    .ok_or("its confirmed_by is not a whole number")?,
            ),
        },
        result_sha256,
        provider_ref: field_text(&fields, "provider_ref")?,
        sequence: signed("sequence")?,
        settled_at: signed("settled_at")?,
        issued_at: signed("issued_at")?,
    })
}

fn field_text(fields: &Map<String, Value>, name: &str) -> Result<Option<String>, String> {
    match &fields[name] {
        Value::Null => Ok(None),
        Value::String(text) => Ok(Some(text.clone())),
        _ => Err(format!("its {name} is not text")),
    }
}

/// The ledger's signing key: the active key of its key file.
#[derive(Clone)]
pub struct SigningKey {
    id: String,
    secret: ed25519_dalek::SigningKey,
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SigningKey")
            .field("id", &self.id)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl SigningKey {
    /// The key whose secret is these 32 bytes (an Ed25519 seed).
    pub fn from_secret(secret: [u8; 32]) -> Self {
        let secret = ed25519_dalek::SigningKey::from_bytes(&secret);
        Self {
            id: key_id(&secret.verifying_key()),
            secret,
        }
    }

    /// The secret, for the key file that keeps it.
    pub fn secret_base64(&self) -> String {
        URL_SAFE_NO_PAD.encode(self.secret.to_bytes())
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn public(&self) -> PublicKey {
        PublicKey {
            id: self.id.clone(),
            key: self.secret.verifying_key(),
        }
    }
}

/// A public key that verifies receipts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey {
    id: String,
    key: ed25519_dalek::VerifyingKey,
}

impl PublicKey {
    /// A public key as `onced signing-keys` prints it: 32 bytes in base64url (padding allowed).
    pub fn parse(text: &str) -> Result<Self, Refused> {
        let bytes: [u8; 32] = URL_SAFE_NO_PAD
            .decode(text.trim().trim_end_matches('='))
            .ok()
            .and_then(|bytes| bytes.try_into().ok())
            .ok_or_else(|| {
                Refused::Malformed("a public key is 32 bytes in base64url".to_owned())
            })?;
        let key = ed25519_dalek::VerifyingKey::from_bytes(&bytes)
            .map_err(|_| Refused::Malformed("that is not an Ed25519 public key".to_owned()))?;
        Ok(Self {
            id: key_id(&key),
            key,
        })
    }

    /// Its id, which receipts it signed name.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&URL_SAFE_NO_PAD.encode(self.key.as_bytes()))
    }
}

fn key_id(key: &ed25519_dalek::VerifyingKey) -> String {
    hex::encode(&Sha256::digest(key.as_bytes())[..8])
}

#[cfg(test)]
#[path = "receipt_tests.rs"]
mod tests;
