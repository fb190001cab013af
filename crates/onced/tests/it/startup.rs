//! What `onced` says when it cannot start: one line naming what is wrong and where, never a
//! backtrace, and nothing touched (no port bound, no database opened) when the configuration
//! is wrong.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;

/// Runs the built `onced` with `args` (and a backtrace asked for), expecting it to stop: its
/// exit code and what it wrote to stderr.
async fn stopped_with(args: &[&str]) -> (Option<i32>, String) {
    let ran = tokio::process::Command::new(env!("CARGO_BIN_EXE_onced"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env_remove("ONCE_ADMIN_KEY")
        .kill_on_drop(true)
        .output();
    let ran = tokio::time::timeout(patient(Duration::from_secs(30)), ran)
        .await
        .unwrap_or_else(|_| panic!("onced {args:?} did not stop"))
        .unwrap();
    (
        ran.status.code(),
        String::from_utf8_lossy(&ran.stderr).into_owned(),
    )
}

/// Each start-up failure is one ERROR line that names the setting, the address, the file or the
/// server and what was found there, exit status 1, with no backtrace even under
/// `RUST_BACKTRACE=1` and no password of the database URL. A configuration file that cannot be
/// read fails before the database is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_up_error_is_one_line_naming_what_and_where() {
    let db = TestDb::new(Engine::Sqlite).await;
    let dir = db.scratch_dir();
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap();
    // A port bound and never listened on: held for the test, and every connection refused.
    let unlistened = tokio::net::TcpSocket::new_v4().unwrap();
    unlistened.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let closed = unlistened.local_addr().unwrap();
    let untouched = dir.join("untouched.db");
    let untouched_url = format!("sqlite://{}", untouched.display());
    let missing = dir.join("missing.toml");
    let pg = format!("postgres://ledger:s3cret-pw@{closed}/once");
    let cases: Vec<(Vec<String>, String)> = vec![
        (
            vec!["--listen".into(), taken.to_string()],
            format!("listening on {taken} (--listen): Address already in use"),
        ),
        (
            vec![
                "--database-url".into(),
                untouched_url.clone(),
                "--config".into(),
                missing.display().to_string(),
            ],
            format!("--config {}: cannot read it", missing.display()),
        ),
        // Every file a setting names is read before a port is bound: the file is named, not
        // the address that is taken too.
        (
            vec![
                "--listen".into(),
                taken.to_string(),
                "--admin-key-file".into(),
                missing.display().to_string(),
            ],
            format!("{}: cannot read it", missing.display()),
        ),
        (
            vec!["--database-url".into(), "sqlite:///proc/nowhere/ledger.db".into()],
            "opening the SQLite database sqlite:///proc/nowhere/ledger.db: cannot create the directory /proc/nowhere".into(),
        ),
        (
            vec!["--database-url".into(), pg.clone()],
            format!("cannot connect to PostgreSQL at postgres://{closed}/once: Connection refused"),
        ),
        (
            vec!["--database-url".into(), "mysql://db/once".into()],
            "--database-url must start with sqlite: or postgres://".into(),
        ),
    ];
    for (args, says) in cases {
        let mut all = vec![
            "--database-url".to_owned(),
            db.url.clone(),
            "--listen".to_owned(),
            "127.0.0.1:0".to_owned(),
        ];
        all.extend(args);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let (code, said) = stopped_with(&all).await;
        assert_eq!(code, Some(1), "{all:?}: {said}");
        let lines: Vec<&str> = said.lines().filter(|l| l.contains(&says)).collect();
        assert_eq!(lines.len(), 1, "{says:?} said once, in:\n{said}");
        assert!(
            lines[0].contains("ERROR") && lines[0].contains("onced stopped: "),
            "{said}"
        );
        assert_eq!(
            said.lines().filter(|l| l.contains("ERROR")).count(),
            1,
            "{said}"
        );
        for never in ["backtrace", "Stack", "s3cret-pw", "panicked"] {
            assert!(!said.contains(never), "{never:?} in:\n{said}");
        }
    }
    assert!(
        !untouched.exists(),
        "a configuration that cannot be read touches no database"
    );
    drop((holder, unlistened));
}

/// A SQLite file in directories that do not exist yet is served: the directories are made,
/// for the owner only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_missing_directories_of_a_sqlite_file_are_made() {
    use std::os::unix::fs::PermissionsExt as _;
    let db = TestDb::new(Engine::Sqlite).await;
    let dir = db.scratch_dir();
    let file = dir.join("var/lib/once/ledger.db");
    let onced = OncedProcess::spawn(
        &format!("sqlite://{}", file.display()),
        dir.join("onced.log"),
        &[],
    )
    .await;
    assert!(file.exists());
    for made in [dir.join("var"), dir.join("var/lib/once")] {
        let mode = std::fs::metadata(&made).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{}", made.display());
    }
    assert!(onced.terminate().await.success());
}

/// With `--wait-for-database`, onced started before its PostgreSQL keeps trying, says so with
/// the server and the cause, and serves once the server answers. The "server" first accepts
/// and closes every connection, then relays to the real one after onced said it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onced_waits_for_a_database_that_comes_up() {
    let db = TestDb::new(Engine::Postgres).await;
    let mut url = reqwest::Url::parse(&db.url).unwrap();
    let real = format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(5432));
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let up = Arc::new(AtomicBool::new(false));
    let relaying = {
        let up = up.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = relay.accept().await else {
                    return;
                };
                if !up.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let real = real.clone();
                tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(&real).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        })
    };
    url.set_host(Some("127.0.0.1")).unwrap();
    url.set_port(Some(relay_addr.port())).unwrap();
    let log = db.scratch_dir().join("onced.log");
    let opener = {
        let log = log.clone();
        tokio::spawn(async move {
            eventually(
                Duration::from_secs(30),
                "onced to say it waits for PostgreSQL",
                || async {
                    let said = std::fs::read_to_string(&log).unwrap_or_default();
                    said.lines()
                        .any(|l| l.contains("waiting for PostgreSQL"))
                        .then_some(said)
                },
            )
            .await
        })
    };
    let serving = tokio::spawn({
        let (url, log) = (url.to_string(), log.clone());
        async move { OncedProcess::spawn(&url, log, &["--wait-for-database", "60s"]).await }
    });
    let said = opener.await.unwrap();
    let waiting = said
        .lines()
        .find(|l| l.contains("waiting for PostgreSQL"))
        .unwrap();
    assert!(
        waiting.contains("WARN") && waiting.contains(&format!("127.0.0.1:{}", relay_addr.port())),
        "{waiting}"
    );
    up.store(true, Ordering::SeqCst);
    let onced = serving.await.unwrap();
    assert!(onced.terminate().await.success());
    relaying.abort();
}
