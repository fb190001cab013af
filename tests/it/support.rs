//! The harness of the integration suite: `once-testkit`, and `onced` processes started from the
//! binary this package builds.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use once_api::pb::ledger_client::LedgerClient;
pub use once_testkit::*;
use tonic::transport::Channel;

/// An `onced` process started from the built binary.
pub struct OncedProcess {
    pub addr: SocketAddr,
    child: tokio::process::Child,
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
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let log_path = log;
        let log = std::fs::File::create(&log_path).expect("log file");
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_onced"))
            .args(["--database-url", url, "--listen", &addr.to_string()])
            .args(TEST_FLAGS)
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("start onced");
        // An onced that exits before it serves says why in its log: fail with that.
        tokio::select! {
            _ = wait_serving(addr) => {}
            exited = child.wait() => panic!(
                "onced exited before serving ({exited:?}): {}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            ),
        }
        OncedProcess { addr, child }
    }

    pub async fn client(&self) -> LedgerClient<Channel> {
        client(self.addr).await
    }

    /// SIGKILL: no chance to finish anything.
    pub async fn kill(mut self) {
        self.child.kill().await.expect("kill onced");
    }

    /// SIGTERM, then waits for the exit status.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().expect("running").to_string();
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
