//! What a phase cost: CPU time per process from /proc, and what PostgreSQL wrote, from its
//! statistics views.

use std::time::Duration;

/// The kernel's clock ticks a second for /proc's CPU times (USER_HZ; 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// CPU time of process `pid` (`self` for this one) in ticks: its own, and with `reaped` that of
/// its children it has waited for.
fn cpu_ticks(pid: &str, reaped: bool) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command's name, in parentheses that may hold anything: field 3 onwards.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let field = |n: usize| -> anyhow::Result<u64> {
        fields
            .get(n - 3)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("no field {n} in /proc/{pid}/stat"))
    };
    let own = field(14)? + field(15)?;
    Ok(match reaped {
        true => own + field(16)? + field(17)?,
        false => own,
    })
}

/// The parent of process `pid`.
fn parent(pid: u32) -> anyhow::Result<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
        .and_then(|ppid| ppid.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no parent in /proc/{pid}/stat"))
}

/// The command name of process `pid`.
fn command(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|name| name.trim_end().to_owned())
}

/// The processes whose CPU a phase is charged: `onced`, the PostgreSQL server (the postmaster,
/// every process it runs, and those it reaped) when it runs on this host, and this process with
/// its children (the callers, or pgbench).
#[derive(Debug, Clone, Copy)]
pub struct Processes {
    pub onced: u32,
    pub postmaster: Option<u32>,
}

/// CPU ticks used so far by each of [`Processes`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuReading {
    onced: u64,
    postgres: Option<u64>,
    load: u64,
}

/// CPU time a phase took, per process group; PostgreSQL's where it runs on this host.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuUsed {
    pub onced: Duration,
    pub postgres: Option<Duration>,
    pub load: Duration,
}

impl Processes {
    /// The postmaster is the parent of the backend serving `backend_pid`'s session, when that
    /// pid is a PostgreSQL process of this host (not one of a remote server, or of a container
    /// with pids of its own).
    pub fn new(onced: u32, backend_pid: u32) -> Self {
        let postmaster = parent(backend_pid)
            .ok()
            .filter(|_| command(backend_pid).as_deref() == Some("postgres"))
            .filter(|&postmaster| command(postmaster).as_deref() == Some("postgres"));
        Self { onced, postmaster }
    }

    pub fn read(&self) -> anyhow::Result<CpuReading> {
        let postgres = match self.postmaster {
            Some(postmaster) => Some(server_ticks(postmaster)?),
            None => None,
        };
        Ok(CpuReading {
            onced: cpu_ticks(&self.onced.to_string(), false)?,
            postgres,
            load: cpu_ticks("self", true)?,
        })
    }
}

/// CPU ticks of the PostgreSQL server so far: the postmaster's with those it reaped, and those
/// of every process it runs.
fn server_ticks(postmaster: u32) -> anyhow::Result<u64> {
    let mut ticks = cpu_ticks(&postmaster.to_string(), true)?;
    for entry in std::fs::read_dir("/proc")? {
        let name = entry?.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        // A process may end between the listing and the read: it is then counted in the
        // postmaster's reaped time instead.
        if parent(pid).ok() == Some(postmaster) {
            ticks += cpu_ticks(&pid.to_string(), false).unwrap_or(0);
        }
    }
    Ok(ticks)
}

impl CpuReading {
    /// What was used from `self` to `later`.
    pub fn until(&self, later: &CpuReading) -> CpuUsed {
        let time = |from: u64, to: u64| {
            Duration::from_secs_f64(to.saturating_sub(from) as f64 / TICKS_PER_SECOND)
        };
        CpuUsed {
            onced: time(self.onced, later.onced),
            postgres: self
                .postgres
                .zip(later.postgres)
                .map(|(from, to)| time(from, to)),
            load: time(self.load, later.load),
        }
    }
}

/// What PostgreSQL wrote so far: rows of the database's tables (`pg_stat_user_tables`), and the
/// server's write-ahead log (`pg_stat_wal`): a record for each row, each index entry and each
/// commit, which is where a write's cost is paid, some carrying a full page image (the first
/// change of a page since the last checkpoint).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    pub rows: i64,
    pub wal_records: i64,
    pub wal_full_pages: i64,
    pub wal_bytes: i64,
}

/// How long a backend may keep what it counted before the statistics views show it: a busy
/// backend reports at most once a second, and one that went idle right after reporting reports
/// the rest ten seconds later (PostgreSQL's `PGSTAT_IDLE_INTERVAL`).
pub const REPORTED_WITHIN: Duration = Duration::from_millis(10_500);

impl Written {
    /// What is counted now, once every backend reported what it did: reads until the figures
    /// have not moved for `quiet` ([`REPORTED_WITHIN`] to be sure of them; less, for a run that
    /// only shows the benchmark works), or a minute passed.
    pub async fn settled(db: &mut sqlx::PgConnection, quiet: Duration) -> anyhow::Result<Self> {
        let mut last = Self::read(db).await?;
        let mut since = tokio::time::Instant::now();
        let give_up = since + Duration::from_secs(60);
        while since.elapsed() < quiet && tokio::time::Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = Self::read(db).await?;
            if now != last {
                last = now;
                since = tokio::time::Instant::now();
            }
        }
        Ok(last)
    }

    async fn read(db: &mut sqlx::PgConnection) -> anyhow::Result<Self> {
        // This session's view of the figures is a snapshot kept for its transaction: drop it.
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *db)
            .await?;
        let (rows, wal_records, wal_full_pages, wal_bytes): (Option<i64>, i64, i64, i64) =
            sqlx::query_as(
                "SELECT (SELECT sum(n_tup_ins + n_tup_upd + n_tup_del)::bigint \
                     FROM pg_stat_user_tables), \
                    wal_records, wal_fpi, wal_bytes::bigint \
             FROM pg_stat_wal",
            )
            .fetch_one(&mut *db)
            .await?;
        Ok(Self {
            rows: rows.unwrap_or(0),
            wal_records,
            wal_full_pages,
            wal_bytes,
        })
    }

    /// What was written from `self` to `later`.
    pub fn until(&self, later: &Written) -> Written {
        Written {
            rows: later.rows - self.rows,
            wal_records: later.wal_records - self.wal_records,
            wal_full_pages: later.wal_full_pages - self.wal_full_pages,
            wal_bytes: later.wal_bytes - self.wal_bytes,
        }
    }
}
