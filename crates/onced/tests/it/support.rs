//! The harness of the integration suite: `once-testkit`, and `onced` processes started from the
//! binary this package builds.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

pub use once_testkit::*;
use tonic::transport::Channel;
pub use tonic_health::pb::health_check_response::ServingStatus;

/// An `onced` process started from the built binary.
pub struct OncedProcess {
    pub addr: SocketAddr,
    child: tokio::process::Child,
    log: PathBuf,
}

/// Keeps the log where `make test` scans every log of the suite for secrets.
impl Drop for OncedProcess {
    fn drop(&mut self) {
        if let Some(kept) = std::env::var_os("ONCE_TEST_LOG_DIR") {
            let kept = PathBuf::from(kept);
            let _ = std::fs::create_dir_all(&kept);
            let name = format!(
                "it-{}-{}",
                uuid::Uuid::new_v4().simple(),
                self.log.file_name().unwrap_or_default().to_string_lossy()
            );
            let _ = std::fs::copy(&self.log, kept.join(name));
        }
    }
}

/// The address in the first line of a log that says `announcement`: a text line's
/// `address=` or a JSON line's `address`.
pub fn announced_address(log: &str, announcement: &str) -> Option<SocketAddr> {
    let line = log.lines().find(|line| line.contains(announcement))?;
    if let Ok(serde_json::Value::Object(fields)) = serde_json::from_str(line) {
        return fields.get("address")?.as_str()?.parse().ok();
    }
    let field = line
        .split_whitespace()
        .find_map(|word| word.strip_prefix("address="))?;
    field.parse().ok()
}

impl OncedProcess {
    pub async fn spawn(url: &str, log: PathBuf, extra: &[&str]) -> Self {
        Self::spawn_with_env(url, log, extra, &[]).await
    }

    /// Starts `onced` with extra environment variables.
    pub async fn spawn_with_env(
        url: &str,
        log: PathBuf,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        Self::launch(url, log, extra, env, |addr| {
            Channel::from_shared(format!("http://{addr}")).unwrap()
        })
        .await
    }

    /// Starts `onced`, waiting until the endpoint `ready` makes of its address serves (an
    /// `https` one for a ledger serving TLS).
    pub async fn launch(
        url: &str,
        log: PathBuf,
        extra: &[&str],
        env: &[(&str, &str)],
        ready: impl FnOnce(SocketAddr) -> tonic::transport::Endpoint,
    ) -> Self {
        Self::launch_under(&[], url, log, extra, env, ready).await
    }

    /// Starts `onced` through the command `wrapper` (`unshare` and a shell that mounts a small
    /// filesystem first, say), which is given onced's path and arguments after its own and
    /// must exec them.
    pub async fn launch_under(
        wrapper: &[&str],
        url: &str,
        log: PathBuf,
        extra: &[&str],
        env: &[(&str, &str)],
        ready: impl FnOnce(SocketAddr) -> tonic::transport::Endpoint,
    ) -> Self {
        // On port 0, learning the port from the log: a port picked in advance could be taken
        // meanwhile (an outgoing connection's local port is drawn from the same range).
        let log_path = log;
        let log = std::fs::File::create(&log_path).expect("log file");
        let onced = env!("CARGO_BIN_EXE_onced");
        let (program, prefix) = match wrapper {
            [] => (onced, &[][..]),
            [program, prefix @ ..] => (*program, prefix),
        };
        let mut command = tokio::process::Command::new(program);
        if !wrapper.is_empty() {
            command.args(prefix).arg(onced);
        }
        let mut child = command
            .args(["--database-url", url, "--listen", "127.0.0.1:0"])
            .args(TEST_FLAGS)
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("start onced");
        // An onced that exits before it serves says why in its log: fail with that.
        let addr = tokio::select! {
            addr = async {
                let addr = eventually(Duration::from_secs(30), "onced to say where it serves", || async {
                    announced_address(
                        &std::fs::read_to_string(&log_path).unwrap_or_default(),
                        "onced serving",
                    )
                })
                .await;
                wait_serving_on(ready(addr)).await;
                addr
            } => addr,
            exited = child.wait() => panic!(
                "onced exited before serving ({exited:?}): {}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            ),
        };
        OncedProcess {
            addr,
            child,
            log: log_path,
        }
    }

    pub async fn client(&self) -> Grpc {
        client(self.addr).await
    }

    /// What it has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }

    /// Sends SIGHUP: re-read the TLS files.
    pub fn hang_up(&self) {
        let pid = self.pid().to_string();
        let sent = std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .expect("kill -HUP");
        assert!(sent.success());
    }

    /// SIGKILL: no chance to finish anything.
    pub async fn kill(mut self) {
        self.child.kill().await.expect("kill onced");
    }

    /// SIGTERM, then waits for the exit status.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.pid().to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill -TERM");
        assert!(sent.success());
        within(
            Duration::from_secs(15),
            "onced to exit after SIGTERM",
            self.child.wait(),
        )
        .await
        .expect("wait for onced")
    }
}

/// What the ledger's health service says of the ledger at `addr`.
pub async fn ledger_health(addr: SocketAddr) -> ServingStatus {
    health_of(addr, "once.ledger.v1.Ledger").await
}

/// What the health service at `addr` says of `service`.
pub async fn health_of(addr: SocketAddr, service: &str) -> ServingStatus {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let reply = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap();
    ServingStatus::try_from(reply.into_inner().status).unwrap()
}

/// Waits until the ledger's health service says `status`.
pub async fn health_is(addr: SocketAddr, status: ServingStatus) {
    eventually(
        Duration::from_secs(10),
        &format!("health to say {status:?}"),
        || async move { (ledger_health(addr).await == status).then_some(()) },
    )
    .await;
}
