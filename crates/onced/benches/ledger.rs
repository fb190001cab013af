//! The ledger beside pgbench. Drives Begin + Confirm cycles on fresh operations over gRPC at
//! 1, 16 and 64 callers against `onced` on PostgreSQL and on SQLite, and runs `pgbench` with
//! the hand-rolled claim + confirm SQL (`bench/pgbench/`) on the same PostgreSQL for the same
//! seconds, interleaved; then 1,000 callers for onced's resident set. Prints a table and each
//! goal's ratio; asserts nothing.
//!
//! Beside each phase's rate it prints the CPU time a cycle cost each process, from /proc:
//! `onced`, the PostgreSQL server (every process of it), and the load (this process's callers,
//! or pgbench); and, at 16 callers, the rows and the write-ahead log PostgreSQL wrote a cycle
//! (its records: a row, an index entry or a commit each), from `pg_stat_user_tables` and
//! `pg_stat_wal`.
//!
//! It also prints what this host allows any ledger behind this API: the callers' gRPC calls
//! with no ledger work behind them (two health checks a cycle), and pgbench writing the rows
//! cycles leave in onced's tables as perfect group commit would, 64 to a commit
//! (`batched_cycles.sql`). A cycle costs at least both, on the same cores.
//!
//! ```text
//! cargo bench -p onced --bench ledger -- [--seconds 10] [--rounds 1] [--callers 1,16,64] \
//!     [--postgres postgres://postgres@127.0.0.1:5432/postgres] [--smoke]
//! ```
//!
//! Both stores are durable as shipped: PostgreSQL with `synchronous_commit` as the server has
//! it, SQLite with `synchronous = FULL`. The benchmark makes a database of its own on the
//! PostgreSQL named and drops it at the end.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::Parser;
use sqlx::Connection as _;
use support::cost::{CpuUsed, Processes, Written};
use support::{cycles, empty_cycles, health_checks, onced, percentile, replays, rss_kib, Cycles};
use tonic::transport::Channel;

mod support;

#[derive(Debug, Parser)]
struct Args {
    /// How long each phase lasts (pgbench counts whole seconds).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// How often the interleaved phases are run; the goals take each figure's median.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// The numbers of concurrent callers to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    callers: Vec<usize>,
    /// Callers of the memory phase.
    #[arg(long, default_value_t = 1000)]
    memory_callers: usize,
    /// A PostgreSQL to make the benchmark's database on.
    #[arg(
        long,
        env = "ONCE_BENCH_POSTGRES",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    postgres: String,
    /// The pgbench binary; found under /usr/lib/postgresql or on PATH when not given.
    #[arg(long, env = "PGBENCH")]
    pgbench: Option<PathBuf>,
    /// Settled operations (with one event each) stored in both databases before measuring, for
    /// how a call's cost grows with what is stored.
    #[arg(long, default_value_t = 0)]
    stored: u64,
    /// One-second phases, one round: to show the benchmark still runs, not to measure.
    #[arg(long)]
    smoke: bool,
    /// Accepted for `cargo bench`'s sake.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The system a phase measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum System {
    OncedPostgres,
    Pgbench,
    OncedSqlite,
    /// Two health checks a cycle against onced on PostgreSQL: the gRPC alone, no ledger work.
    GrpcAlone,
    /// pgbench writing what a cycle leaves in onced's tables, 64 cycles to a commit
    /// (`batched_cycles.sql`): the database work alone, as perfect group commit would do it.
    BatchedRows,
}

impl System {
    fn label(self) -> &'static str {
        match self {
            System::OncedPostgres => "onced, PostgreSQL",
            System::Pgbench => "pgbench, hand-rolled SQL",
            System::OncedSqlite => "onced, SQLite",
            System::GrpcAlone => "gRPC alone, no ledger work",
            System::BatchedRows => "pgbench, onced's rows, 64/commit",
        }
    }
}

/// What one phase measured.
#[derive(Debug, Clone)]
struct Figures {
    system: System,
    callers: usize,
    per_second: f64,
    /// onced: Begin; pgbench: the claim statement alone (its own 1-caller phase).
    first_p50: Option<Duration>,
    first_p99: Option<Duration>,
    cycle_p99: Option<Duration>,
    failed: u64,
    /// Cycles done in the phase.
    done: f64,
    /// The CPU time the phase took, per process.
    cpu: CpuUsed,
    /// What PostgreSQL wrote in the phase, where measured.
    written: Option<Written>,
}

impl Figures {
    /// A rate alone, as pgbench reports it: `done` cycles in `length`.
    fn rate(system: System, callers: usize, done: f64, length: Duration) -> Self {
        Self {
            system,
            callers,
            per_second: done / length.as_secs_f64(),
            first_p50: None,
            first_p99: None,
            cycle_p99: None,
            failed: 0,
            done,
            cpu: CpuUsed::default(),
            written: None,
        }
    }

    /// CPU milliseconds a cycle took of `of`.
    fn cpu_per_cycle(&self, of: fn(&CpuUsed) -> Option<Duration>) -> Option<f64> {
        let used = of(&self.cpu).filter(|_| self.done > 0.0)?;
        Some(ms(used) / self.done)
    }

    /// Rows, write-ahead log records, full page images and bytes written a cycle.
    fn written_per_cycle(&self) -> Option<[f64; 4]> {
        let written = self.written.filter(|_| self.done > 0.0)?;
        Some(
            [
                written.rows,
                written.wal_records,
                written.wal_full_pages,
                written.wal_bytes,
            ]
            .map(|n| n as f64 / self.done),
        )
    }
}

/// A running `onced` and where it serves.
struct Ledger {
    child: tokio::process::Child,
    channels: Vec<Channel>,
}

impl Ledger {
    async fn start(url: &str, log: &Path) -> anyhow::Result<Self> {
        let (child, address) = onced(env!("CARGO_BIN_EXE_onced"), url, log, None).await?;
        let mut channels = Vec::new();
        // Up to 16 connections; gRPC multiplexes more callers over them.
        for _ in 0..16 {
            channels.push(
                Channel::from_shared(format!("http://{address}"))?
                    .connect()
                    .await?,
            );
        }
        Ok(Self { child, channels })
    }

    fn pid(&self) -> u32 {
        self.child.id().expect("onced is running")
    }

    /// `callers` callers making cycles for `length`; with the peak resident set over it.
    async fn drive(&self, callers: usize, length: Duration) -> anyhow::Result<(Cycles, u64)> {
        self.drive_with(System::OncedPostgres, callers, length)
            .await
    }

    /// As [`Ledger::drive`], with the cycles `system` makes: ledger cycles, or empty ones.
    async fn drive_with(
        &self,
        system: System,
        callers: usize,
        length: Duration,
    ) -> anyhow::Result<(Cycles, u64)> {
        let end = Instant::now() + length;
        let running: Vec<_> = (0..callers)
            .map(|n| {
                let channel = self.channels[n % self.channels.len()].clone();
                match system {
                    System::GrpcAlone => tokio::spawn(empty_cycles(channel, end)),
                    _ => tokio::spawn(cycles(channel, end)),
                }
            })
            .collect();
        let mut peak = rss_kib(self.pid())?;
        while Instant::now() < end {
            peak = peak.max(rss_kib(self.pid())?);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut seen = Cycles::default();
        for caller in running {
            seen.merge(caller.await?);
        }
        Ok((seen, peak.max(rss_kib(self.pid())?)))
    }

    async fn measure(
        &self,
        system: System,
        callers: usize,
        length: Duration,
    ) -> anyhow::Result<Figures> {
        let (mut seen, _) = self.drive_with(system, callers, length).await?;
        seen.begins.sort();
        seen.cycles.sort();
        Ok(Figures {
            first_p50: Some(percentile(&seen.begins, 50.0)),
            first_p99: Some(percentile(&seen.begins, 99.0)),
            cycle_p99: Some(percentile(&seen.cycles, 99.0)),
            failed: seen.failed,
            ..Figures::rate(system, callers, seen.done as f64, length)
        })
    }
}

/// The cycles one run of `batched_cycles.sql` writes.
const BATCHED_CYCLES: f64 = 64.0;

/// pgbench on the benchmark's database.
struct Pgbench {
    binary: PathBuf,
    url: String,
    scripts: PathBuf,
    logs: PathBuf,
}

impl Pgbench {
    /// Runs `script` with `clients` for `seconds`; returns the transactions processed and,
    /// when `logged`, every transaction's latency.
    async fn run(
        &self,
        script: &str,
        clients: usize,
        seconds: u64,
        logged: bool,
    ) -> anyhow::Result<(f64, Vec<Duration>)> {
        let prefix = self.logs.join(format!("pgbench-{clients}"));
        let mut command = tokio::process::Command::new(&self.binary);
        command
            .args(["--no-vacuum", "--protocol=prepared"])
            .arg(format!("--client={clients}"))
            .arg(format!("--jobs={}", clients.min(2)))
            .arg(format!("--time={}", seconds.max(1)))
            .arg(format!("--file={}", self.scripts.join(script).display()))
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .stdout(Stdio::piped());
        if logged {
            command
                .arg("--log")
                .arg(format!("--log-prefix={}", prefix.display()));
        }
        let output = command.arg(&self.url).output().await?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        anyhow::ensure!(
            output.status.success(),
            "pgbench failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let processed = stdout
            .lines()
            .find_map(|line| line.strip_prefix("number of transactions actually processed: "))
            .and_then(|rest| rest.split(['/', ' ']).next())
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("no transaction count in pgbench's output: {stdout}"))?;
        let mut latencies = Vec::new();
        if logged {
            for entry in std::fs::read_dir(&self.logs)? {
                let path = entry?.path();
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                if !name.starts_with(&format!("pgbench-{clients}.")) {
                    continue;
                }
                // client, transaction, latency in µs, script, epoch s, µs.
                for line in std::fs::read_to_string(&path)?.lines() {
                    if let Some(us) = line.split_whitespace().nth(2).and_then(|v| v.parse().ok()) {
                        latencies.push(Duration::from_micros(us));
                    }
                }
                std::fs::remove_file(&path)?;
            }
        }
        Ok((processed, latencies))
    }
}

/// Stores `count` CONFIRMED operations, kept for years, each with its CLAIMED event, in chunks.
/// `blob` writes a byte string literal from its hex digits in the database's dialect.
async fn store_settled<C>(db: &mut C, count: u64, blob: fn(&str) -> String) -> anyhow::Result<()>
where
    C: sqlx::Connection,
    for<'c> &'c mut C: sqlx::Executor<'c>,
{
    const CHUNK: u64 = 100_000;
    let far = 9_000_000_000_000_i64; // the year 2255
                                     // Recorded now: nothing for the sweepers to delete while the benchmark measures.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    let mut done = 0;
    while done < count {
        let (first, last) = (done + 1, (done + CHUNK).min(count));
        let numbers = format!(
            "WITH RECURSIVE g(n) AS (SELECT {first} UNION ALL SELECT n + 1 FROM g WHERE n < {last})"
        );
        let statements = [
            format!(
                "{numbers} INSERT INTO operations (tenant, operation_id, tool, fingerprint, state, \
                 source, attempt, attempt_id, lease_started_at, lease_deadline, provider_key, \
                 retention_ms, created_at, updated_at, expires_at, result) \
                 SELECT 'default', 'stored-' || n, 'issue_refund', {zero}, 'CONFIRMED', 'attempt', 1, \
                 'a', {now}, {now}, 'k-' || n, 0, {now}, {now}, {far}, {braces} FROM g",
                zero = blob("00"),
                braces = blob("7b7d")
            ),
            format!(
                "{numbers} INSERT INTO events (tenant, operation_id, at, kind, actor) \
                 SELECT 'default', 'stored-' || n, {now}, 'CLAIMED', 'executor:default' FROM g"
            ),
        ];
        for sql in statements {
            sqlx::raw_sql(&sql).execute(&mut *db).await?;
        }
        done = last;
    }
    sqlx::raw_sql("ANALYZE").execute(&mut *db).await?;
    Ok(())
}

/// The pgbench that ships with PostgreSQL.
fn find_pgbench() -> anyhow::Result<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|version| version.path().join("bin/pgbench"))
        .filter(|path| path.exists())
        .collect();
    found.sort();
    if let Some(newest) = found.pop() {
        return Ok(newest);
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join("pgbench"))
        .find(|path| path.exists())
        .ok_or_else(|| anyhow::anyhow!("no pgbench under /usr/lib/postgresql or on PATH"))
}

/// `url` naming database `name` instead.
fn with_database(url: &str, name: &str) -> String {
    let (base, _) = url.rsplit_once('/').unwrap_or((url, ""));
    format!("{base}/{name}")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn show(figures: &Figures) {
    let cell = |d: Option<Duration>| d.map_or("-".to_string(), |d| format!("{:.3}", ms(d)));
    let cpu = |of: fn(&CpuUsed) -> Option<Duration>| {
        figures
            .cpu_per_cycle(of)
            .map_or("-".to_string(), |ms| format!("{ms:.3}"))
    };
    let written = figures
        .written_per_cycle()
        .map_or("-".to_string(), |[rows, records, ..]| {
            format!("{rows:.1}/{records:.1}")
        });
    println!(
        "{:>7}  {:<32} {:>10.0} {:>10} {:>10} {:>11} {:>7} {:>9} {:>9} {:>9} {:>10}",
        figures.callers,
        figures.system.label(),
        figures.per_second,
        cell(figures.first_p50),
        cell(figures.first_p99),
        cell(figures.cycle_p99),
        figures.failed,
        cpu(|c| Some(c.onced)),
        cpu(|c| c.postgres),
        cpu(|c| Some(c.load)),
        written,
    );
}

/// Runs `phase`, and charges it the CPU time each process took meanwhile; with `db`, also what
/// PostgreSQL wrote.
async fn costed(
    processes: &Processes,
    mut db: Option<(&mut sqlx::PgConnection, Duration)>,
    phase: impl std::future::Future<Output = anyhow::Result<Figures>>,
) -> anyhow::Result<Figures> {
    let written = match db.as_mut() {
        Some((db, quiet)) => Some(Written::settled(db, *quiet).await?),
        None => None,
    };
    let before = processes.read()?;
    let mut figures = phase.await?;
    figures.cpu = before.until(&processes.read()?);
    if let (Some((db, quiet)), Some(from)) = (db, written) {
        figures.written = Some(from.until(&Written::settled(db, quiet).await?));
    }
    Ok(figures)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if args.smoke {
        args.seconds = 1;
        args.rounds = 1;
    }
    let length = Duration::from_secs(args.seconds);
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/pgbench");
    let dir = tempfile::tempdir()?;

    // A database of the benchmark's own, with onced's tables (made by onced) and the
    // hand-rolled one beside them.
    let name = format!("once_bench_{}", std::process::id());
    let mut admin = sqlx::PgConnection::connect(&args.postgres).await?;
    sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name}"))
        .execute(&mut admin)
        .await?;
    sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await?;
    let url = with_database(&args.postgres, &name);
    let outcome = run(&args, length, &scripts, dir.path(), &url).await;
    sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    outcome
}

async fn run(
    args: &Args,
    length: Duration,
    scripts: &Path,
    dir: &Path,
    url: &str,
) -> anyhow::Result<()> {
    let mut db = sqlx::PgConnection::connect(url).await?;
    sqlx::raw_sql(&std::fs::read_to_string(scripts.join("schema.sql"))?)
        .execute(&mut db)
        .await?;
    let (version,): (String,) = sqlx::query_as("SHOW server_version")
        .fetch_one(&mut db)
        .await?;
    let (synchronous,): (String,) = sqlx::query_as("SHOW synchronous_commit")
        .fetch_one(&mut db)
        .await?;
    let pgbench = Pgbench {
        binary: args.pgbench.clone().map_or_else(find_pgbench, Ok)?,
        url: url.to_string(),
        scripts: scripts.to_path_buf(),
        logs: dir.to_path_buf(),
    };

    let postgres = Ledger::start(url, &dir.join("onced-postgres.log")).await?;
    let sqlite_url = format!("sqlite://{}", dir.join("bench.db").display());
    let sqlite = Ledger::start(&sqlite_url, &dir.join("onced-sqlite.log")).await?;
    if args.stored > 0 {
        let started = Instant::now();
        store_settled(&mut db, args.stored, |hex| format!("'\\x{hex}'::bytea")).await?;
        let mut file = sqlx::SqliteConnection::connect(&sqlite_url).await?;
        store_settled(&mut file, args.stored, |hex| format!("X'{hex}'")).await?;
        // Into the database file: measured is a ledger holding them, not one copying a load
        // out of its write-ahead log.
        sqlx::raw_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(&mut file)
            .await?;
        println!(
            "stored {} settled operations in each database in {:.0} s",
            args.stored,
            started.elapsed().as_secs_f64()
        );
    }
    // Warm, then idle: the resident set of a ledger that has served and waits.
    let mut idle = Vec::new();
    for ledger in [&postgres, &sqlite] {
        ledger.drive(1, Duration::from_millis(300)).await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for ledger in [&postgres, &sqlite] {
        idle.push(rss_kib(ledger.pid())?);
    }

    println!(
        "PostgreSQL {version} (synchronous_commit = {synchronous}) and SQLite (synchronous = FULL, WAL) \
         on this host; {} s per phase, {} round(s); a cycle is Begin + Confirm of a fresh operation",
        args.seconds, args.rounds
    );
    println!(
        "{:>7}  {:<32} {:>10} {:>10} {:>10} {:>11} {:>7} {:>9} {:>9} {:>9} {:>10}",
        "callers",
        "system",
        "cycles/s",
        "p50 ms",
        "p99 ms",
        "cycle p99",
        "failed",
        "onced ms",
        "PG ms",
        "load ms",
        "rows/WAL"
    );
    let (backend,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut db)
        .await?;
    let on_postgres = Processes::new(postgres.pid(), backend.try_into()?);
    let on_sqlite = Processes::new(sqlite.pid(), backend.try_into()?);
    if on_postgres.postmaster.is_none() {
        println!(
            "PostgreSQL runs on another host (or in pids of its own): its CPU is not measured"
        );
    }
    // Counted writes need every backend's report; a smoke run only shows they are counted.
    let quiet = match args.smoke {
        true => Duration::from_millis(1_100),
        false => support::cost::REPORTED_WITHIN,
    };
    // Where the CPU goals are stated, and what PostgreSQL writes a cycle is counted.
    let costed_at = if args.callers.contains(&16) {
        16
    } else {
        args.callers.iter().copied().max().unwrap_or(1)
    };
    let mut all = Vec::new();
    for _ in 0..args.rounds {
        for &callers in &args.callers {
            let counted = (callers == costed_at).then_some((&mut db, quiet));
            let onced_postgres = costed(
                &on_postgres,
                counted,
                postgres.measure(System::OncedPostgres, callers, length),
            )
            .await?;
            let counted = (callers == costed_at).then_some((&mut db, quiet));
            let pgbench_cycles = costed(&on_postgres, counted, async {
                let (done, _) = pgbench
                    .run("claim_confirm.sql", callers, args.seconds, false)
                    .await?;
                Ok(Figures::rate(System::Pgbench, callers, done, length))
            })
            .await?;
            let mut pgbench_cycles = pgbench_cycles;
            if callers == 1 {
                let (_, mut claims) = pgbench.run("claim.sql", 1, args.seconds, true).await?;
                claims.sort();
                pgbench_cycles.first_p50 = Some(percentile(&claims, 50.0));
                pgbench_cycles.first_p99 = Some(percentile(&claims, 99.0));
            }
            let onced_sqlite = costed(
                &on_sqlite,
                None,
                sqlite.measure(System::OncedSqlite, callers, length),
            )
            .await?;
            for figures in [onced_postgres, pgbench_cycles, onced_sqlite] {
                show(&figures);
                all.push(figures);
            }
        }
        // The bounds: the same callers making the calls' gRPC round trips and nothing else, and
        // the database writing a cycle's rows with nothing else (four batches in flight).
        let most = args.callers.iter().copied().max().unwrap_or(1);
        let alone = costed(
            &on_postgres,
            None,
            postgres.measure(System::GrpcAlone, most, length),
        )
        .await?;
        let rows = costed(&on_postgres, None, async {
            let (batches, _) = pgbench
                .run("batched_cycles.sql", 4, args.seconds, false)
                .await?;
            Ok(Figures::rate(
                System::BatchedRows,
                most,
                batches * BATCHED_CYCLES,
                length,
            ))
        })
        .await?;
        for figures in [alone, rows] {
            show(&figures);
            all.push(figures);
        }
    }

    let mut replayed = Vec::new();
    for ledger in [&postgres, &sqlite] {
        let latencies = replays(ledger.channels[0].clone(), Instant::now() + length).await?;
        let floor = health_checks(ledger.channels[0].clone(), Instant::now() + length / 2).await?;
        replayed.push((
            percentile(&latencies, 50.0),
            percentile(&latencies, 99.0),
            percentile(&floor, 50.0),
        ));
    }

    let mut peaks = Vec::new();
    for ledger in [&postgres, &sqlite] {
        let (seen, peak) = ledger.drive(args.memory_callers, length).await?;
        peaks.push((peak, seen.done as f64 / length.as_secs_f64()));
    }
    println!("p50/p99: onced's Begin; pgbench's claim statement alone, at 1 caller");
    for (store, (p50, p99, floor)) in ["PostgreSQL", "SQLite"].iter().zip(&replayed) {
        println!(
            "a Begin answered REPLAY, 1 caller, onced on {store}: p50 {:.3} ms, p99 {:.3} ms \
             (a health check, no store call: p50 {:.3} ms)",
            ms(*p50),
            ms(*p99),
            ms(*floor)
        );
    }

    let pick = |system: System, callers: usize, of: &dyn Fn(&Figures) -> Option<f64>| {
        let values: Vec<f64> = all
            .iter()
            .filter(|f| f.system == system && f.callers == callers)
            .filter_map(of)
            .collect();
        (!values.is_empty()).then(|| median(values))
    };
    type Of = fn(&Figures) -> Option<f64>;
    let rate: Of = |f| Some(f.per_second);
    let p50: Of = |f| f.first_p50.map(ms);
    let p99: Of = |f| f.first_p99.map(ms);
    let cycle_p99: Of = |f| f.cycle_p99.map(ms);
    let most = args.callers.iter().copied().max().unwrap_or(1);
    let fewest = args.callers.iter().copied().min().unwrap_or(1);

    println!();
    println!("{:<66} {:>10} {:>10}", "goal", "measured", "target");
    let goal = |what: String, measured: Option<String>, target: &str| {
        println!(
            "{what:<66} {:>10} {target:>10}",
            measured.unwrap_or_else(|| "-".into())
        );
    };
    let onced_rate = pick(System::OncedPostgres, most, &rate);
    let ratio = onced_rate
        .zip(pick(System::Pgbench, most, &rate))
        .map(|(onced, pgbench)| onced / pgbench);
    goal(
        format!("cycles/s at {most} callers, onced on PostgreSQL / pgbench"),
        ratio.map(|r| format!("{r:.2}x")),
        ">= 1.0x",
    );
    // Both bounds are CPU-bound on this host and would share it: a cycle costs at least the CPU
    // of its gRPC calls plus that of its rows, whatever the ledger does between them.
    let bound = pick(System::GrpcAlone, most, &rate)
        .zip(pick(System::BatchedRows, most, &rate))
        .map(|(alone, rows)| 1.0 / (1.0 / alone + 1.0 / rows));
    goal(
        format!("bound: gRPC alone + onced's rows batched, at {most} callers / pgbench"),
        bound
            .zip(pick(System::Pgbench, most, &rate))
            .map(|(bound, pgbench)| format!("{:.2}x", bound / pgbench)),
        "(host)",
    );
    goal(
        format!("share of the bound onced on PostgreSQL reaches at {most} callers"),
        onced_rate
            .zip(bound)
            .map(|(onced, bound)| format!("{:.0}%", 100.0 * onced / bound)),
        ">= 60%",
    );
    let cpu = |system: System, of: fn(&CpuUsed) -> Option<Duration>| {
        let values: Vec<f64> = all
            .iter()
            .filter(|f| f.system == system && f.callers == costed_at)
            .filter_map(|f| f.cpu_per_cycle(of))
            .collect();
        (!values.is_empty()).then(|| format!("{:.3}", median(values)))
    };
    goal(
        format!("PostgreSQL CPU a cycle at {costed_at} callers, onced (ms)"),
        cpu(System::OncedPostgres, |c| c.postgres),
        "<= 0.35",
    );
    goal(
        format!("onced CPU a cycle at {costed_at} callers, on PostgreSQL (ms)"),
        cpu(System::OncedPostgres, |c| Some(c.onced)),
        "<= 0.15",
    );
    goal(
        format!("PostgreSQL CPU a cycle at {costed_at} callers, pgbench (ms)"),
        cpu(System::Pgbench, |c| c.postgres),
        "(host)",
    );
    for system in [System::OncedPostgres, System::Pgbench] {
        let written = all
            .iter()
            .filter(|f| f.system == system)
            .find_map(Figures::written_per_cycle);
        goal(
            format!(
                "rows / WAL records / full pages / bytes a cycle, {}",
                system.label()
            ),
            written.map(|[rows, records, pages, bytes]| {
                format!("{rows:.1} / {records:.1} / {pages:.1} / {bytes:.0}")
            }),
            "(info)",
        );
    }
    let excess = |of: Of| {
        pick(System::OncedPostgres, fewest, &of)
            .zip(pick(System::Pgbench, fewest, &of))
            .map(|(begin, claim)| format!("{:+.3}", begin - claim))
    };
    goal(
        format!("Begin p50 at {fewest} caller - pgbench claim p50 (ms)"),
        excess(p50),
        "<= +0.50",
    );
    goal(
        format!("Begin p99 at {fewest} caller - pgbench claim p99 (ms)"),
        excess(p99),
        "(info)",
    );
    // A Begin is at least a gRPC round trip around the claim's statement.
    let floor = replayed.first().map(|(_, _, health)| ms(*health));
    goal(
        "bound: Begin p50 - claim p50 >= a health check's p50 (ms)".to_string(),
        floor.map(|f| format!("{f:+.3}")),
        "(host)",
    );
    goal(
        format!("SQLite cycles/s at {costed_at} callers"),
        pick(System::OncedSqlite, costed_at, &rate).map(|r| format!("{r:.0}")),
        ">= 1500",
    );
    goal(
        format!("SQLite cycle p99 at {most} callers (ms)"),
        pick(System::OncedSqlite, most, &cycle_p99).map(|p| format!("{p:.1}")),
        "<= 50",
    );
    let mib = |kib: u64| kib as f64 / 1024.0;
    for ((store, idle), (peak, rate)) in ["PostgreSQL", "SQLite"].iter().zip(&idle).zip(&peaks) {
        goal(
            format!("onced RSS idle, {store} (MiB)"),
            Some(format!("{:.1}", mib(*idle))),
            "<= 50",
        );
        goal(
            format!(
                "onced RSS peak, {store}, {} callers at {rate:.0} cycles/s (MiB)",
                args.memory_callers
            ),
            Some(format!("{:.1}", mib(*peak))),
            "<= 200",
        );
    }
    Ok(())
}
