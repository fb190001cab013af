//! Validated conversions between API messages and domain types.
//!
//! Every inbound function either returns a domain command that satisfies the core's
//! expectations or an [`Invalid`] naming the request field at fault; it never touches storage.
//!
//! [`request`] holds the inbound direction (a message to a domain command, with its checks),
//! [`response`] the outbound one (domain values to messages); both are re-exported here.

mod request;
mod response;

pub use request::*;
pub use response::*;

use once_core::*;
use prost_types::{Duration, Timestamp};

/// Longest attempt id, provider name, operator name or resolution id.
pub(crate) const MAX_NAME_BYTES: usize = 128;
/// Shortest attempt id: one unique per attempt, not a JSON-RPC id unique only per session.
pub const MIN_ATTEMPT_ID_BYTES: usize = 16;
/// Most states a ListOperations filter names: each state once.
pub(crate) const MAX_LISTED_STATES: usize = State::ALL.len();
/// Longest transport context value (client name, session id, request id).
pub(crate) const MAX_CONTEXT_BYTES: usize = 256;
/// Longest provider reference.
pub(crate) const MAX_PROVIDER_REF_BYTES: usize = 255;
/// Largest ListOperations page.
pub const MAX_PAGE_SIZE: u32 = 1000;
pub(crate) const DEFAULT_PAGE_SIZE: u32 = 100;

pub fn timestamp(ms: Millis) -> Timestamp {
    Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
    }
}

pub fn duration(ms: i64) -> Duration {
    Duration {
        seconds: ms / 1000,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// Milliseconds since the epoch of a timestamp (for clients).
pub fn millis(ts: &Timestamp) -> Millis {
    ts.seconds * 1000 + i64::from(ts.nanos / 1_000_000)
}

#[cfg(test)]
mod validation_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_tokens_round_trip_and_reject_garbage() {
        let one = PageEnd {
            created_at: 1_700_000_000_123,
            tenant: String::new(),
            operation_id: "refund:o1".into(),
        };
        let token = encode_page_token(&one);
        assert_eq!(decode_page_token(&token), Some(one.clone()));
        let every = PageEnd {
            tenant: "acme".into(),
            ..one
        };
        let across = encode_page_token(&every);
        assert_eq!(decode_page_token(&across), Some(every));
        let bad_tenant = hex::encode([&[0u8; 8][..], b"Not a tenant\0refund:o1"].concat());
        for bad in [
            "",
            "zz",
            "00",
            &token[..token.len() - 1],
            "0000000000000000",
            &bad_tenant,
        ] {
            assert_eq!(decode_page_token(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn timestamps_round_trip_before_and_after_the_epoch() {
        for ms in [0, 1, 999, 1000, -1, -1001, 1_700_000_000_123] {
            assert_eq!(millis(&timestamp(ms)), ms);
        }
    }
}
