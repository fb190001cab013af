//! once-client against real ledgers: `onced` on real sockets over real SQLite files and
//! PostgreSQL databases (see `once-testkit`), reached the way an MCP server reaches it.

mod client;

mod support {
    pub use once_testkit::*;
}
