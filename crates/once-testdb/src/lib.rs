//! Fresh, empty databases for once-ledger's test suites, one per test: a SQLite file in a
//! directory of its own, or a PostgreSQL database on the server `ONCE_TEST_POSTGRES_URL` names
//! (127.0.0.1:5432 by default), dropped when the test ends. A PostgreSQL server that cannot be
//! reached fails the test; nothing is skipped.

use std::path::PathBuf;

/// Which backend a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

/// Defines the tests `name::sqlite` and `name::postgres` from `async fn name(store: Engine)`:
/// one suite, every backend.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    super::$name($crate::Engine::Sqlite).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    super::$name($crate::Engine::Postgres).await
                }
            }
        )*
    };
}

/// The PostgreSQL server tests create their databases on. Unreachable means failed, not skipped.
pub fn postgres_admin_url() -> String {
    std::env::var("ONCE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// A fresh, empty database, dropped when the test ends.
#[derive(Debug)]
pub struct TestDb {
    pub store: Engine,
    pub url: String,
    /// Its own directory, whichever the store: for the SQLite file, logs and files a test
    /// writes, never shared with a test running beside it.
    dir: tempfile::TempDir,
    pg_name: Option<String>,
}

impl TestDb {
    pub async fn new(store: Engine) -> Self {
        match store {
            Engine::Sqlite => {
                let dir = tempfile::tempdir().expect("temporary directory");
                let url = format!("sqlite://{}", dir.path().join("ledger.db").display());
                TestDb {
                    store,
                    url,
                    dir,
                    pg_name: None,
                }
            }
            Engine::Postgres => {
                let name = format!("once_it_{}", uuid::Uuid::new_v4().simple());
                let admin = postgres_admin_url();
                let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&admin)
                    .await
                    .unwrap_or_else(|e| {
                        panic!(
                            "PostgreSQL must be reachable at {admin} for the postgres tests: {e}"
                        )
                    });
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut conn)
                    .await
                    .expect("create test database");
                let url = replace_database(&admin, &name);
                TestDb {
                    store,
                    url,
                    dir: tempfile::tempdir().expect("temporary directory"),
                    pg_name: Some(name),
                }
            }
        }
    }

    /// The PostgreSQL database's name.
    pub fn pg_name(&self) -> &str {
        self.pg_name.as_deref().expect("a PostgreSQL test database")
    }

    /// Runs `sql` on the PostgreSQL server as its administrator, with `{db}` standing for this
    /// test's database (for settings of the database itself: refusing connections, read-only).
    pub async fn as_server_admin(&self, sql: &str) {
        let sql = sql.replace("{db}", self.pg_name());
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&postgres_admin_url())
            .await
            .expect("connect postgres as its administrator");
        sqlx::query(&sql).execute(&mut conn).await.expect(&sql);
    }

    /// Ends every session on this PostgreSQL test database: a pool must connect anew.
    pub async fn end_sessions(&self) {
        self.as_server_admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{db}' AND pid <> pg_backend_pid()",
        )
        .await;
    }

    /// A directory that lives as long as the database, for logs.
    pub fn scratch_dir(&self) -> PathBuf {
        self.dir.path().to_owned()
    }

    /// Runs one SQL statement directly against the database and returns the first column of
    /// the first row as an integer (0 when there is no row). The same text runs on both
    /// backends.
    pub async fn scalar(&self, sql: &str) -> i64 {
        self.integers(sql).await.first().copied().unwrap_or(0)
    }

    /// Runs one query directly and returns the first column of every row as an integer.
    pub async fn integers(&self, sql: &str) -> Vec<i64> {
        match self.store {
            Engine::Sqlite => {
                let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&self.url)
                    .await
                    .expect("open sqlite");
                sqlx::query_scalar::<_, i64>(sql)
                    .fetch_all(&mut conn)
                    .await
                    .expect(sql)
            }
            Engine::Postgres => {
                let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&self.url)
                    .await
                    .expect("connect postgres");
                sqlx::query_scalar::<_, i64>(sql)
                    .fetch_all(&mut conn)
                    .await
                    .expect(sql)
            }
        }
    }

    /// Executes a statement directly; returns the rows affected.
    pub async fn execute(&self, sql: &str) -> u64 {
        match self.store {
            Engine::Sqlite => {
                let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&self.url)
                    .await
                    .expect("open sqlite");
                sqlx::query(sql)
                    .execute(&mut conn)
                    .await
                    .expect(sql)
                    .rows_affected()
            }
            Engine::Postgres => {
                let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&self.url)
                    .await
                    .expect("connect postgres");
                sqlx::query(sql)
                    .execute(&mut conn)
                    .await
                    .expect(sql)
                    .rows_affected()
            }
        }
    }

    /// The database's clock, in milliseconds since the epoch: the clock leases and settle times
    /// are measured on.
    pub async fn clock(&self) -> i64 {
        self.scalar(match self.store {
            Engine::Postgres => "SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
            Engine::Sqlite => "SELECT CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
        })
        .await
    }

    /// Copies the database as it is now, as a backup [`TestDb::restore`] puts back. Nothing may
    /// be using it (stop its ledgers first): the SQLite file with its write-ahead log, or a
    /// PostgreSQL database made from this one as a template.
    pub async fn back_up(&self) {
        match self.store {
            Engine::Sqlite => {
                let backup = self.dir.path().join("backup");
                std::fs::create_dir_all(&backup).expect("backup directory");
                for name in ["ledger.db", "ledger.db-wal", "ledger.db-shm"] {
                    let from = self.dir.path().join(name);
                    let _ = std::fs::remove_file(backup.join(name));
                    if from.exists() {
                        std::fs::copy(&from, backup.join(name)).expect("copy the database");
                    }
                }
            }
            Engine::Postgres => {
                self.end_sessions().await;
                self.as_server_admin("DROP DATABASE IF EXISTS {db}_backup")
                    .await;
                self.as_server_admin("CREATE DATABASE {db}_backup TEMPLATE {db}")
                    .await;
            }
        }
    }

    /// Puts the backup [`TestDb::back_up`] made in place of the database: a restore to an
    /// earlier state. Nothing may be using it.
    pub async fn restore(&self) {
        match self.store {
            Engine::Sqlite => {
                let backup = self.dir.path().join("backup");
                for name in ["ledger.db", "ledger.db-wal", "ledger.db-shm"] {
                    let to = self.dir.path().join(name);
                    let _ = std::fs::remove_file(&to);
                    if backup.join(name).exists() {
                        std::fs::copy(backup.join(name), &to).expect("restore the database");
                    }
                }
            }
            Engine::Postgres => {
                self.as_server_admin("DROP DATABASE {db} WITH (FORCE)")
                    .await;
                self.as_server_admin("CREATE DATABASE {db} TEMPLATE {db}_backup")
                    .await;
            }
        }
    }

    /// Row counts of every table, to show a refused request changed nothing.
    pub async fn snapshot(&self) -> [i64; 3] {
        [
            self.scalar("SELECT count(*) FROM operations").await,
            self.scalar("SELECT count(*) FROM attempts").await,
            self.scalar("SELECT count(*) FROM events").await,
        ]
    }
}

fn replace_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (url, String::new()),
    };
    let base = base.rsplit_once('/').map_or(base, |(head, _)| head);
    format!("{base}/{name}{query}")
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some(name) = self.pg_name.take() {
            let admin = postgres_admin_url();
            // Drop runs outside any runtime we may block, so use a thread with its own.
            let _ = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(async {
                    if let Ok(mut conn) =
                        <sqlx::PgConnection as sqlx::Connection>::connect(&admin).await
                    {
                        for name in [name.clone(), format!("{name}_backup")] {
                            let _ = sqlx::query(&format!(
                                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                            ))
                            .execute(&mut conn)
                            .await;
                        }
                    }
                });
            })
            .join();
        }
    }
}
