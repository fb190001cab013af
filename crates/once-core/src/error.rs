//! Validation errors: every refusal names the request field it is about.

use std::fmt;

/// The name of a request field, as the caller spells it in the API (`begin.tool`, ...).
pub type Field = &'static str;

/// A malformed request. Nothing was read or written because of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct Invalid {
    /// The field at fault, in API spelling.
    pub field: String,
    /// What is wrong with it, for a human.
    pub message: String,
    /// A machine-readable reason code (`INVALID_FIELD`, `RESULT_TOO_LARGE`, ...).
    pub code: &'static str,
}

impl Invalid {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
            code: "INVALID_FIELD",
        }
    }

    /// Gives the error a more specific reason code.
    pub fn with_code(self, code: &'static str) -> Self {
        Self { code, ..self }
    }

    /// Re-homes an error found inside a nested value under the field that holds it.
    pub fn within(self, field: &str) -> Self {
        Self {
            field: if self.field.is_empty() {
                field.to_owned()
            } else {
                format!("{field}.{}", self.field)
            },
            message: self.message,
            code: self.code,
        }
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}
