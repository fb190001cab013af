//! The store's own suites, on SQLite and on PostgreSQL (the server `ONCE_TEST_POSTGRES_URL`
//! names; unreachable fails): `conformance`, what every [`crate::Backend`] must do, and
//! `plans`, that the statements the store sends read by an index what they read.

mod conformance;
mod plans;

use once_testdb::{Engine, TestDb};

/// Makes the ledger's schema in `db`, as a replica does when it first opens it.
async fn schema(db: &TestDb) {
    match db.store {
        Engine::Sqlite => {
            let backend = crate::SqliteBackend::connect(&db.url).await.unwrap();
            crate::Backend::close(&backend).await;
        }
        Engine::Postgres => {
            let settings = crate::postgres::PgSettings::default();
            let backend = crate::PgBackend::connect(&db.url, &settings).await.unwrap();
            crate::Backend::close(&backend).await;
        }
    }
}
