//! Opening the database the configuration names: a SQLite file, or PostgreSQL, waited for
//! while it comes up when asked to; every failure names the database and what to do.

use anyhow::Context as _;
use once_store::postgres::PgSettings;
use once_store::{PgBackend, SqliteBackend};

use crate::Config;

pub(crate) async fn sqlite(config: &Config) -> anyhow::Result<SqliteBackend> {
    let opening = || format!("opening the SQLite database {}", config.database_shown());
    match SqliteBackend::connect(&config.database_url).await {
        Ok(backend) => Ok(backend),
        // A file or directory that cannot be made: its own words, which name it.
        Err(once_store::StoreError::Internal(sqlx::Error::Configuration(cause))) => {
            Err(anyhow::anyhow!("{cause}").context(opening()))
        }
        Err(error) => Err(anyhow::Error::new(error).context(opening())),
    }
}

pub(crate) async fn postgres(config: &Config) -> anyhow::Result<PgBackend> {
    reach_postgres(config).await?;
    let settings = PgSettings {
        max_connections: config.db_max_connections,
        acquire_timeout: config.db_acquire_timeout,
    };
    PgBackend::connect(&config.database_url, &settings)
        .await
        .with_context(|| format!("connecting to PostgreSQL at {}", config.database_shown()))
}

/// Returns once one connection to PostgreSQL opens, trying for `--wait-for-database` while
/// what stops it may pass; else says where and why, and what to do.
async fn reach_postgres(config: &Config) -> anyhow::Result<()> {
    let shown = config.database_shown();
    let deadline = tokio::time::Instant::now() + config.wait_for_database;
    let mut tries = 0u32;
    loop {
        let unreached =
            match PgBackend::reach(&config.database_url, config.db_acquire_timeout).await {
                Ok(()) => return Ok(()),
                Err(unreached) => unreached,
            };
        tries += 1;
        let waiting = unreached.passes && tokio::time::Instant::now() < deadline;
        if !waiting {
            let hint = match (unreached.passes, config.wait_for_database.is_zero()) {
                (true, true) => " (--wait-for-database 60s keeps trying while it comes up)".into(),
                (true, false) => format!(
                    " (tried for --wait-for-database {})",
                    humantime::format_duration(config.wait_for_database)
                ),
                (false, _) => String::new(),
            };
            anyhow::bail!(
                "cannot connect to PostgreSQL at {shown}: {}{hint}",
                unreached.cause
            );
        }
        // The first failures, then one in ten: a person watching sees it wait, a log is not
        // flooded.
        if tries <= 3 || tries.is_multiple_of(10) {
            tracing::warn!(database = %shown, cause = %unreached.cause, tries, "waiting for PostgreSQL");
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}
