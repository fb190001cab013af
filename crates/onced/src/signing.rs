//! The ledger's signing keys: the key file, its rotation, and the receipts signed with it.
//!
//! The key file holds one active Ed25519 key, whose secret signs receipts, and the public halves
//! of the keys it replaced, so that receipts they signed still verify:
//!
//! ```text
//! # once-ledger signing keys …
//! active 5f3a9c0e12ab4d67 <secret, 32 bytes base64url>
//! retired 0b1c2d3e4f506172 <public key, 32 bytes base64url>
//! ```
//!
//! Every replica of one ledger reads the same file. It never reaches the database, so whoever
//! can write the database cannot sign a receipt.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use once_core::receipt::{self, PublicKey, Receipt, SigningKey};
use once_core::{Event, Millis, Operation, State};

const HEADER: &str = "\
# once-ledger signing keys. The active key signs receipts; a retired key's public half stays so
# that the receipts it signed still verify. Keep this file secret (mode 0600) and give every
# replica of the ledger the same copy. `onced signing-keys rotate` replaces the active key.
";

/// The keys of a key file.
#[derive(Debug, Clone)]
pub struct KeyRing {
    path: PathBuf,
    active: SigningKey,
    retired: Vec<PublicKey>,
}

/// A public key, and whether it is the one signing now.
#[derive(Debug, Clone)]
pub struct Listed {
    pub key: PublicKey,
    pub active: bool,
}

impl KeyRing {
    /// Reads the key file at `path`.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = fs::read_to_string(path)
            .with_context(|| format!("reading the signing key file {}", path.display()))?;
        warn_if_readable_by_others(path);
        Self::parse(path, &text).with_context(|| format!("in {}", path.display()))
    }

    /// Reads the key file at `path`, creating it with a new key when there is none. Of two
    /// processes creating it at once, one key is kept and both read it.
    pub fn load_or_create(path: &Path) -> anyhow::Result<Self> {
        if path.exists() {
            return Self::load(path);
        }
        let ring = Self {
            path: path.to_owned(),
            active: new_key()?,
            retired: Vec::new(),
        };
        if !ring.write(false)? {
            return Self::load(path);
        }
        tracing::info!(
            path = %path.display(),
            key = ring.active.id(),
            "created a signing key file for receipts"
        );
        Ok(ring)
    }

    fn parse(path: &Path, text: &str) -> anyhow::Result<Self> {
        let mut active = None;
        let mut retired = Vec::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = number + 1;
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [kind, id, material] = fields[..] else {
                bail!("line {at}: expected `active|retired ID KEY`");
            };
            let public = match kind {
                "active" => {
                    let secret: [u8; 32] =
                        decode(material).with_context(|| format!("line {at}: the secret"))?;
                    let key = SigningKey::from_secret(secret);
                    let public = key.public();
                    if active.replace(key).is_some() {
                        bail!("line {at}: a second active key (one signs at a time)");
                    }
                    public
                }
                "retired" => {
                    let public = PublicKey::parse(material)
                        .map_err(|refused| anyhow::anyhow!("line {at}: {refused}"))?;
                    retired.push(public.clone());
                    public
                }
                other => bail!("line {at}: {other:?} is neither active nor retired"),
            };
            if public.id() != id {
                bail!("line {at}: the key's id is {}, not {id}", public.id());
            }
        }
        let active = active.context("no active key")?;
        retired.retain(|key| key.id() != active.id());
        Ok(Self {
            path: path.to_owned(),
            active,
            retired,
        })
    }

    /// Replaces the active key with a new one; the old one's public half stays, retired.
    pub fn rotate(&mut self) -> anyhow::Result<()> {
        let old = std::mem::replace(&mut self.active, new_key()?);
        self.retired.insert(0, old.public());
        self.write(true).map(|_| ())
    }

    /// The key that signs.
    pub fn active(&self) -> &SigningKey {
        &self.active
    }

    /// Every public key: the active one first, then the retired ones, newest first.
    pub fn listed(&self) -> Vec<Listed> {
        let active = Listed {
            key: self.active.public(),
            active: true,
        };
        let retired = self.retired.iter().map(|key| Listed {
            key: key.clone(),
            active: false,
        });
        std::iter::once(active).chain(retired).collect()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the file whole: a new file beside it, synced, then renamed over it (`replace`) or
    /// linked in its place only if there is none, and the directory synced, so a crash leaves
    /// the old file or the new one. Whether it was written (not: another was there first).
    fn write(&self, replace: bool) -> anyhow::Result<bool> {
        let mut text = HEADER.to_owned();
        text.push_str(&format!(
            "active {} {}\n",
            self.active.id(),
            self.active.secret_base64()
        ));
        for key in &self.retired {
            text.push_str(&format!("retired {} {key}\n", key.id()));
        }
        let dir = match self.path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
            _ => PathBuf::from("."),
        };
        let name = self
            .path
            .file_name()
            .context("the signing key file's path names no file")?;
        let mut unique = [0u8; 8];
        getrandom::getrandom(&mut unique).context("drawing a file name")?;
        let temporary = dir.join(format!(
            ".{}.{}.new",
            name.to_string_lossy(),
            unique
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        ));
        let mut options = fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options
            .open(&temporary)
            .with_context(|| format!("writing {}", temporary.display()))?;
        let written = file
            .write_all(text.as_bytes())
            .and_then(|()| file.sync_all())
            .and_then(|()| match replace {
                true => fs::rename(&temporary, &self.path).map(|()| true),
                false => match fs::hard_link(&temporary, &self.path) {
                    Ok(()) => Ok(true),
                    Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
                    Err(error) => Err(error),
                },
            });
        let _ = fs::remove_file(&temporary);
        let written = written.with_context(|| format!("writing {}", self.path.display()))?;
        if let Ok(dir) = fs::File::open(&dir) {
            let _ = dir.sync_all();
        }
        Ok(written)
    }
}

fn new_key() -> anyhow::Result<SigningKey> {
    let mut secret = [0u8; 32];
    getrandom::getrandom(&mut secret).context("drawing a signing key from the OS")?;
    Ok(SigningKey::from_secret(secret))
}

fn decode(text: &str) -> anyhow::Result<[u8; 32]> {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(text.trim_end_matches('='))
        .ok()
        .and_then(|bytes| bytes.try_into().ok())
        .context("not 32 bytes of base64url")
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    if let Ok(meta) = fs::metadata(path) {
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(
                path = %path.display(),
                "the signing key file can be read by others than its owner: chmod 600 it"
            );
        }
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_: &Path) {}

/// Where a replica's signing keys come from, as its settings say.
#[derive(Debug, Clone)]
pub enum Signing {
    /// It signs no receipts.
    None,
    Ring(Box<KeyRing>),
    /// The key file to make on the first start, once the database is open.
    Create(PathBuf),
}

impl Signing {
    /// The key ring, made now when it is to be made. A default key file that cannot be made
    /// leaves the ledger serving without receipts, and saying so.
    pub fn ring(&self) -> Option<KeyRing> {
        match self {
            Signing::None => None,
            Signing::Ring(ring) => Some(ring.as_ref().clone()),
            Signing::Create(path) => match KeyRing::load_or_create(path) {
                Ok(ring) => Some(ring),
                Err(error) => {
                    tracing::warn!(
                        "no receipts are signed: the signing key file could not be made: {error:#}"
                    );
                    None
                }
            },
        }
    }
}

/// What a replica signs receipts with: its key ring, when it has one, and the ledger's identity.
#[derive(Debug, Clone)]
pub struct Receipts {
    ring: Option<std::sync::Arc<KeyRing>>,
    ledger: String,
}

impl Receipts {
    pub fn new(ring: Option<KeyRing>, ledger: &str) -> Self {
        Self {
            ring: ring.map(std::sync::Arc::new),
            ledger: ledger.to_owned(),
        }
    }

    pub fn ring(&self) -> Option<&KeyRing> {
        self.ring.as_deref()
    }

    pub fn ledger(&self) -> &str {
        &self.ledger
    }

    /// Signs the receipt of `op`, settled as the chain recorded in `settled`.
    pub fn sign(&self, op: &Operation, settled: Settled) -> Option<String> {
        let ring = self.ring.as_deref()?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| {
                Millis::try_from(since.as_millis()).unwrap_or(Millis::MAX)
            });
        Some(receipt_of(ring, &self.ledger, op, settled, now))
    }
}

/// The event that settled an operation, as its chain linked it.
#[derive(Debug, Clone, Copy)]
pub struct Settled {
    pub sequence: i64,
    pub at: Millis,
}

/// Why an operation's receipt cannot be signed now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unsigned {
    NotSettled(State),
    /// Its settling event is not in the chain yet (about a second after it commits).
    NotLinkedYet,
    /// Retention deleted its settling event.
    EventGone,
    /// What is stored does not match what the chain recorded: the history was rewritten.
    DoesNotMatch(String),
}

/// Finds the event that settled `op` (CONFIRMED or ABSENT) among its history `events`, and
/// checks the row and that event against the link that recorded it: a receipt says only what
/// the chain holds too, so a row or an event edited in the database is not signed.
pub async fn settled<B: once_store::Backend>(
    backend: &B,
    op: &Operation,
    events: &[Event],
) -> Result<Result<Settled, Unsigned>, once_store::StoreError> {
    if !matches!(op.state, State::Confirmed | State::Absent) {
        return Ok(Err(Unsigned::NotSettled(op.state)));
    }
    // The latest event that moved the operation: the one that left it in its state.
    let Some(latest) = events
        .iter()
        .filter(|event| event.to.is_some())
        .max_by_key(|event| event.sequence)
    else {
        return Ok(Err(Unsigned::EventGone));
    };
    if latest.to != Some(op.state) {
        return Ok(Err(Unsigned::DoesNotMatch(format!(
            "the operation is {} but its latest event (sequence {}) left it {}",
            op.state,
            latest.sequence,
            latest.to.map_or("nothing", State::as_str)
        ))));
    }
    if backend.chained_through().await? < latest.sequence {
        return Ok(Err(Unsigned::NotLinkedYet));
    }
    let tenant = op.tenant.as_str();
    let Some(link) = backend
        .links(tenant, latest.sequence - 1, 1)
        .await?
        .into_iter()
        .next()
        .filter(|link| link.after < latest.sequence && latest.sequence <= link.through)
    else {
        return Ok(Err(Unsigned::DoesNotMatch(format!(
            "no link of the chain covers event {}",
            latest.sequence
        ))));
    };
    let linked = backend
        .tenant_events(tenant, (link.after, link.through), u32::MAX >> 1)
        .await?;
    if !linked
        .iter()
        .any(|(event, _)| event.sequence == latest.sequence)
    {
        return Ok(Err(Unsigned::EventGone));
    }
    let deleted_through = backend.deleted_through().await?;
    if let Err(problem) = once_core::chain::check_link(&link, None, &linked, deleted_through) {
        return Ok(Err(Unsigned::DoesNotMatch(problem.to_string())));
    }
    Ok(Ok(Settled {
        sequence: latest.sequence,
        at: latest.at,
    }))
}

/// Signs the receipt of `op`, settled CONFIRMED or ABSENT by the event `settled`.
pub fn receipt_of(
    ring: &KeyRing,
    ledger: &str,
    op: &Operation,
    settled: Settled,
    now: Millis,
) -> String {
    let confirmed = op.state == State::Confirmed;
    let receipt = Receipt {
        ledger: ledger.to_owned(),
        key: String::new(),
        tenant: op.tenant.clone(),
        operation_id: op.operation_id.as_str().to_owned(),
        tool: op.tool.clone(),
        life: op.life.get(),
        state: op.state,
        source: op.source.as_str().to_owned(),
        attempt: op.attempt,
        fencing_token: op.fencing_token.get(),
        confirmed_by: op
            .confirmed_by
            .filter(|token| confirmed && *token != op.fencing_token)
            .map(|token| token.get()),
        result_sha256: op
            .result
            .as_deref()
            .filter(|_| confirmed)
            .map(receipt::result_sha256),
        provider_ref: op.provider_ref.clone().filter(|_| confirmed),
        sequence: settled.sequence,
        settled_at: settled.at,
        issued_at: now,
    };
    receipt.sign(ring.active())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_file_is_created_rotated_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("signing.key");
        let first = KeyRing::load_or_create(&path).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let again = KeyRing::load_or_create(&path).unwrap();
        assert_eq!(again.active().id(), first.active().id());
        let mut rotated = again.clone();
        rotated.rotate().unwrap();
        let read = KeyRing::load(&path).unwrap();
        let ids: Vec<(String, bool)> = read
            .listed()
            .into_iter()
            .map(|listed| (listed.key.id().to_owned(), listed.active))
            .collect();
        assert_eq!(
            ids,
            [
                (rotated.active().id().to_owned(), true),
                (first.active().id().to_owned(), false)
            ]
        );
    }

    #[test]
    fn processes_creating_the_key_file_at_once_keep_one_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("signing.key");
        for _ in 0..20 {
            let _ = fs::remove_file(&path);
            let ids: Vec<String> = std::thread::scope(|scope| {
                let made: Vec<_> = (0..4)
                    .map(|_| scope.spawn(|| KeyRing::load_or_create(&path).unwrap()))
                    .collect();
                made.into_iter()
                    .map(|made| made.join().unwrap().active().id().to_owned())
                    .collect()
            });
            let kept = KeyRing::load(&path).unwrap();
            assert!(ids.iter().all(|id| id == kept.active().id()), "{ids:?}");
        }
        let left: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file is left: {left:?}");
    }

    #[test]
    fn a_key_file_that_does_not_add_up_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("signing.key");
        let ring = KeyRing::load_or_create(&path).unwrap();
        let good = fs::read_to_string(&path).unwrap();
        let active = good.lines().find(|l| l.starts_with("active")).unwrap();
        let public = ring.active().public();
        for (text, says) in [
            (String::new(), "no active key"),
            (format!("{active}\n{active}\n"), "a second active key"),
            (
                active.replace("active", "current"),
                "neither active nor retired",
            ),
            (
                active.replacen(ring.active().id(), "0000000000000000", 1),
                "the key's id is",
            ),
            (
                format!("{active}\nretired {} short\n", public.id()),
                "base64url",
            ),
            (format!("{active} extra\n"), "expected"),
        ] {
            let refused = KeyRing::parse(&path, &text).unwrap_err();
            assert!(
                format!("{refused:#}").contains(says),
                "{text:?}: {refused:#}"
            );
        }
    }
}
