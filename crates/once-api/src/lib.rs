//! The `once.ledger.v1` gRPC API.
//!
//! This is the only crate that knows prost types. [`convert`] turns each request into a
//! validated domain command (refusing malformed input with the field it is about) and each
//! domain answer back into its message, so a generated type never reaches the core.

pub mod admin;
pub mod codec;
pub mod convert;
#[cfg(test)]
mod fuzz_tests;
pub mod refusal;

/// The response header of WatchOperations naming the sequence the stream starts after, so a
/// watch from now that breaks before its first message resumes there.
pub const WATCH_START_HEADER: &str = "once-after-sequence";

/// The `ErrorInfo.domain` of every error the ledger returns.
pub const ERROR_DOMAIN: &str = "once.ledger.v1";

/// Generated messages, client and server for `once.ledger.v1`.
#[allow(missing_debug_implementations, clippy::all)]
pub mod pb {
    tonic::include_proto!("once.ledger.v1");
}

/// Generated messages, client and server for `once.reconciler.v1`, the plugin protocol.
#[allow(missing_debug_implementations, clippy::all)]
pub mod reconciler_pb {
    tonic::include_proto!("once.reconciler.v1");
}

/// Generated messages, client and server for `once.admin.v1`: tenants and credentials.
#[allow(missing_debug_implementations, clippy::all)]
pub mod admin_pb {
    tonic::include_proto!("once.admin.v1");
}

impl std::fmt::Debug for admin_pb::CreateKeyResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreateKeyResponse")
            .field("key", &self.key)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// The encoded descriptors of every file of the API, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));
