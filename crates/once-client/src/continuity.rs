//! What this client saw of each ledger, so that a ledger restored to an earlier state cannot
//! execute again what it forgot (see `once_core::continuity`).
//!
//! With every execution right the ledger hands out a sealed position. [`Positions`] keeps, per
//! ledger, the highest (by epoch, then fencing token) and the latest [`Positions::KEPT`]; the
//! client sends the highest with every Begin. A ledger behind it refuses to execute
//! (LEDGER_BEHIND), and the client then reports the positions it kept, so that each operation
//! the ledger lost comes back UNKNOWN for its reconciler instead of running again.
//!
//! Kept in memory by default, which covers a ledger restored while this process runs; kept in a
//! file ([`Positions::open`]), it also covers one restored while this process was down. The
//! file is a log of sealed positions, one a line, each written and synced before the effect it
//! grants runs; it is rewritten with only what is kept once it holds twice that. It holds no
//! secret: a position is readable by whoever may read the operation.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead as _, Read as _, Seek as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use once_core::continuity::{peek, Position};

/// The positions this client saw. Cheap to clone; clones share them.
#[derive(Debug, Clone)]
pub struct Positions {
    inner: Arc<Mutex<Kept>>,
}

#[derive(Debug, Default)]
struct Kept {
    /// How many of a ledger's latest positions are kept ([`Positions::KEPT`]).
    keep: usize,
    file: Option<Log>,
    ledgers: HashMap<String, Seen>,
    /// The ledger of the latest position recorded: the one the client talks to.
    current: Option<String>,
    /// When the kept positions were last reported, per ledger.
    reported: HashMap<String, Instant>,
}

#[derive(Debug)]
struct Log {
    path: PathBuf,
    file: File,
    lines: usize,
}

/// One ledger's positions: the highest, the latest, and the latest of each operation among
/// them.
#[derive(Debug, Default)]
struct Seen {
    highest: Option<((u64, u64), String)>,
    latest: VecDeque<(String, String)>,
    by_operation: HashMap<String, String>,
}

impl Seen {
    fn add(&mut self, position: &Position, sealed: String, keep: usize) {
        let rank = (position.epoch, position.token.get());
        if self.highest.as_ref().is_none_or(|(top, _)| rank > *top) {
            self.highest = Some((rank, sealed.clone()));
        }
        if self.latest.len() >= keep {
            if let Some((operation, oldest)) = self.latest.pop_front() {
                if self.by_operation.get(&operation) == Some(&oldest) {
                    self.by_operation.remove(&operation);
                }
            }
        }
        let operation = position.operation_id.to_string();
        self.by_operation.insert(operation.clone(), sealed.clone());
        self.latest.push_back((operation, sealed));
    }

    /// Forgets one position, the highest then being the highest of the rest.
    fn forget(&mut self, sealed: &str) {
        self.latest.retain(|(_, kept)| kept != sealed);
        self.by_operation.retain(|_, kept| kept != sealed);
        if self.highest.as_ref().is_some_and(|(_, top)| top == sealed) {
            self.highest = self
                .latest
                .iter()
                .filter_map(|(_, kept)| peek(kept).ok().map(|p| ((p.epoch, p.token.get()), kept)))
                .max_by_key(|(rank, _)| *rank)
                .map(|(rank, kept)| (rank, kept.clone()));
        }
    }
}

impl Positions {
    /// How many of a ledger's latest positions are kept to report.
    pub const KEPT: usize = 10_000;

    /// How often the kept positions are reported to a ledger that keeps refusing.
    const REPORT_AGAIN: Duration = Duration::from_secs(60);

    /// Positions kept in memory only.
    pub fn in_memory() -> Self {
        Self::keeping(Self::KEPT)
    }

    fn keeping(keep: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Kept {
                keep,
                ..Kept::default()
            })),
        }
    }

    /// Positions kept in the file at `path` (made, with its directory, when missing; readable
    /// by its owner only), starting from what it holds.
    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        Self::open_keeping(path, Self::KEPT)
    }

    fn open_keeping(path: impl AsRef<Path>, keep: usize) -> io::Result<Self> {
        let path = path.as_ref().to_owned();
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)?;
        }
        let existed = path.exists();
        let mut options = OpenOptions::new();
        options.create(true).read(true).append(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(&path).map_err(|e| named(&path, e))?;
        // One process a file: another's compaction would rename the file from under this one.
        file.try_lock().map_err(|e| match e {
            std::fs::TryLockError::WouldBlock => io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "{}: in use by another process (give each its own)",
                    path.display()
                ),
            ),
            std::fs::TryLockError::Error(e) => named(&path, e),
        })?;
        if !existed {
            sync_directory(&path)?;
        }

        let mut kept = Kept {
            keep,
            ..Kept::default()
        };
        let mut lines = 0;
        for line in io::BufReader::new(&file).lines() {
            let line = line.map_err(|e| named(&path, e))?;
            lines += 1;
            // A line cut short by a crash while it was written is skipped.
            if let Ok(position) = peek(line.trim()) {
                kept.current = Some(position.ledger.clone());
                kept.ledgers
                    .entry(position.ledger.clone())
                    .or_default()
                    .add(&position, line.trim().to_owned(), keep);
            }
        }
        // A line a crash cut short is ended, so the next one is not joined to it.
        let length = file.metadata()?.len();
        if length > 0 {
            let mut last = [0u8; 1];
            file.seek(io::SeekFrom::Start(length - 1))?;
            file.read_exact(&mut last)?;
            if last != *b"\n" {
                file.write_all(b"\n")?;
                file.sync_data()?;
            }
        }
        kept.file = Some(Log { path, file, lines });
        Ok(Self {
            inner: Arc::new(Mutex::new(kept)),
        })
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The highest position seen of the ledger the client talks to, to send with a Begin.
    pub fn highest(&self) -> Option<String> {
        let kept = self.kept();
        let ledger = kept.current.as_ref()?;
        kept.ledgers
            .get(ledger)?
            .highest
            .as_ref()
            .map(|(_, sealed)| sealed.clone())
    }

    /// The latest positions kept of `ledger`, oldest first.
    pub fn latest(&self, ledger: &str) -> Vec<String> {
        self.kept()
            .ledgers
            .get(ledger)
            .map(|seen| {
                seen.latest
                    .iter()
                    .map(|(_, sealed)| sealed.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The latest position kept of `operation_id`, of the ledger the client talks to.
    pub fn of_operation(&self, operation_id: &str) -> Option<String> {
        let kept = self.kept();
        let ledger = kept.current.as_ref()?;
        kept.ledgers
            .get(ledger)?
            .by_operation
            .get(operation_id)
            .cloned()
    }

    /// Forgets a position the ledger refused to read (a damaged line): kept, it would have
    /// every Begin refused. The file is rewritten without it.
    pub fn forget(&self, sealed: &str) -> io::Result<()> {
        let mut kept = self.kept();
        for seen in kept.ledgers.values_mut() {
            seen.forget(sealed);
        }
        compact(&mut kept)
    }

    /// The ledger the client talks to, as its latest position names it.
    pub fn ledger(&self) -> Option<String> {
        self.kept().current.clone()
    }

    /// Records a position the ledger handed out, in the file (written and synced) when there
    /// is one. One that cannot be read is not kept.
    pub async fn record(&self, sealed: &str) -> io::Result<()> {
        let Ok(position) = peek(sealed) else {
            return Ok(());
        };
        let this = self.clone();
        let sealed = sealed.to_owned();
        // The file is written and synced off the async threads.
        tokio::task::spawn_blocking(move || this.record_now(&position, sealed))
            .await
            .map_err(io::Error::other)?
    }

    fn record_now(&self, position: &Position, sealed: String) -> io::Result<()> {
        let mut kept = self.kept();
        // In memory first: a file that cannot be written loses the position for a restart
        // of this process only.
        let line = format!("{sealed}\n");
        if kept.current.as_deref() != Some(position.ledger.as_str()) {
            if let Some(before) = &kept.current {
                tracing::warn!(
                    before = %before,
                    now = %position.ledger,
                    "the ledger's identity changed: positions of the one before prove nothing to this one"
                );
            }
            kept.current = Some(position.ledger.clone());
        }
        let keep = kept.keep;
        kept.ledgers
            .entry(position.ledger.clone())
            .or_default()
            .add(position, sealed, keep);
        if let Some(log) = &mut kept.file {
            log.file.write_all(line.as_bytes())?;
            log.file.sync_data()?;
            log.lines += 1;
        }
        let bound = 2 * keep * kept.ledgers.len().max(1);
        if kept.file.as_ref().is_some_and(|log| log.lines > bound) {
            compact(&mut kept)?;
        }
        Ok(())
    }

    /// Whether the kept positions of `ledger` are due to be reported (at most once a minute),
    /// counting this as the report.
    pub(crate) fn due_report(&self, ledger: &str) -> bool {
        let mut kept = self.kept();
        let due = kept
            .reported
            .get(ledger)
            .is_none_or(|at| at.elapsed() >= Self::REPORT_AGAIN);
        if due {
            kept.reported.insert(ledger.to_owned(), Instant::now());
        }
        due
    }
}

/// Rewrites the file with only what is kept: a new file synced, then renamed over the old.
fn compact(kept: &mut Kept) -> io::Result<()> {
    let Some(log) = &kept.file else { return Ok(()) };
    let path = log.path.clone();
    let fresh = path.with_extension("compacting");
    let mut options = OpenOptions::new();
    options.create(true).write(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(&fresh)?;
    let mut lines = 0;
    // The current ledger's last, so that it is the current one when the file is read again.
    let mut ledgers: Vec<(&String, &Seen)> = kept.ledgers.iter().collect();
    ledgers.sort_by_key(|(ledger, _)| Some(*ledger) == kept.current.as_ref());
    for (_, seen) in ledgers {
        let highest = seen.highest.iter().map(|(_, sealed)| sealed);
        for sealed in highest.chain(seen.latest.iter().map(|(_, sealed)| sealed)) {
            file.write_all(format!("{sealed}\n").as_bytes())?;
            lines += 1;
        }
    }
    file.sync_all()?;
    // The new file is locked before it takes the name, and this handle, at its end, goes on
    // writing to it: no other process can take it meanwhile.
    file.lock()?;
    std::fs::rename(&fresh, &path)?;
    sync_directory(&path)?;
    kept.file = Some(Log { path, file, lines });
    Ok(())
}

/// Makes a file's creation or renaming durable: its directory is synced.
fn sync_directory(path: &Path) -> io::Result<()> {
    let directory = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(directory)?.sync_all()
}

fn named(path: &Path, error: io::Error) -> io::Error {
    io::Error::new(error.kind(), format!("{}: {error}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use once_core::continuity::Seal;
    use once_core::{FencingToken, Fingerprint, OperationId};

    fn sealed(ledger: &str, epoch: u64, token: u64) -> String {
        let position = Position {
            ledger: ledger.into(),
            epoch,
            tenant: "t".into(),
            operation_id: OperationId::parse("id", &format!("refund:{token}")).unwrap(),
            tool: "refund".into(),
            fingerprint: Fingerprint([1; 32]),
            life: FencingToken(token),
            attempt: 1,
            token: FencingToken(token),
            provider: None,
            provider_key: "k".into(),
            lookup_hints: None,
            retention_ms: 1,
            at: 1,
        };
        Seal::new(ledger, [3; 32]).seal(&position)
    }

    #[tokio::test]
    async fn the_highest_by_epoch_then_token_is_sent_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/positions");
        let positions = Positions::open(&path).unwrap();
        assert_eq!(positions.highest(), None);
        for (epoch, token) in [(0, 5), (0, 9), (0, 7), (1, 2), (1, 1)] {
            positions.record(&sealed("a", epoch, token)).await.unwrap();
        }
        assert_eq!(positions.highest(), Some(sealed("a", 1, 2)));
        assert_eq!(positions.latest("a").len(), 5);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // One process a file.
        let refused = Positions::open(&path).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::WouldBlock, "{refused}");
        drop(positions);
        // A line cut short by a crash is skipped, and the next one is not joined to it.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"p1.eyJsZWRn")
            .unwrap();
        let again = Positions::open(&path).unwrap();
        assert_eq!(again.highest(), Some(sealed("a", 1, 2)));
        assert_eq!(again.latest("a").len(), 5);
        again.record(&sealed("a", 1, 3)).await.unwrap();
        drop(again);
        let again = Positions::open(&path).unwrap();
        assert_eq!(again.highest(), Some(sealed("a", 1, 3)));
        assert_eq!(again.of_operation("refund:3"), Some(sealed("a", 1, 3)));
        // A position the ledger cannot read is forgotten, in the file too.
        again.forget(&sealed("a", 1, 3)).unwrap();
        assert_eq!(again.highest(), Some(sealed("a", 1, 2)));
        drop(again);
        let again = Positions::open(&path).unwrap();
        assert_eq!(again.highest(), Some(sealed("a", 1, 2)));
        assert_eq!(again.of_operation("refund:3"), None);
        // Another ledger's positions are kept apart; the one talked to last is sent.
        again.record(&sealed("b", 0, 3)).await.unwrap();
        assert_eq!(again.highest(), Some(sealed("b", 0, 3)));
        assert_eq!(again.ledger().as_deref(), Some("b"));
    }

    #[tokio::test]
    async fn the_file_is_compacted_to_what_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("positions");
        let keep = 50;
        let positions = Positions::open_keeping(&path, keep).unwrap();
        let total = 2 * keep + 10;
        for token in 1..=total as u64 {
            positions
                .record_now(
                    &peek(&sealed("a", 0, token)).unwrap(),
                    sealed("a", 0, token),
                )
                .unwrap();
        }
        let lines = std::fs::read_to_string(&path).unwrap().lines().count();
        assert!(lines <= keep + 20, "{lines} lines");
        drop(positions);
        let again = Positions::open_keeping(&path, keep).unwrap();
        assert_eq!(again.highest(), Some(sealed("a", 0, total as u64)));
        assert_eq!(again.latest("a").len(), keep);
    }
}
