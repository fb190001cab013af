//! Which events a watcher may be sent: the watermark.
//!
//! Events are numbered by a sequence handed out in time order, but the transactions writing
//! them commit in any order: a reader may see event 12 committed while event 11 is still being
//! written. A watcher that resumes after 12 would then never see 11. So a replica sends events
//! only up to the *watermark*, a sequence below which every event that will ever be committed
//! is already visible.
//!
//! Where writers commit in sequence order (SQLite's one write lock), the newest visible event
//! is the watermark. In PostgreSQL every write transaction holds a shared advisory lock, the
//! write gate, from its first statement to its end, and so from before it takes a sequence
//! number until after its commit is visible. One statement reads the newest visible sequence
//! and then the transactions holding the gate: any transaction that could still commit an
//! older event held the gate when the sequence was read, so it is among them. Once none of them
//! holds the gate any more, that newest sequence is the watermark.

/// What one reading of the store says about its events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Frontier {
    /// The newest event sequence visible when it was read (0 when there is none).
    pub newest: i64,
    /// The transactions that held the write gate just after, by their virtual transaction id;
    /// empty where writers commit in sequence order.
    pub writing: Vec<String>,
}

/// Readings of the [`Frontier`] followed to the watermark.
#[derive(Debug, Default)]
pub struct Watermark {
    /// Every event up to this sequence that will ever be visible is visible.
    reached: i64,
    /// Newer sequences read, each with the transactions that must end before it is reached,
    /// oldest first.
    pending: Vec<(i64, Vec<String>)>,
}

/// Most readings kept pending while a transaction holds the gate for long; beyond it every
/// other one is forgotten, which only delays the watermark.
const MAX_PENDING: usize = 256;

impl Watermark {
    /// Takes a new reading and returns the watermark.
    pub fn observe(&mut self, frontier: Frontier) -> i64 {
        let Frontier { newest, writing } = frontier;
        let last = self.pending.last().map_or(self.reached, |(n, _)| *n);
        if newest > last {
            self.pending.push((newest, writing.clone()));
        }
        let mut reached = self.reached;
        self.pending.retain(|(sequence, held)| {
            let ended = !held.iter().any(|t| writing.contains(t));
            if ended {
                reached = reached.max(*sequence);
            }
            !ended
        });
        self.pending.retain(|(sequence, _)| *sequence > reached);
        self.reached = reached;
        if self.pending.len() > MAX_PENDING {
            let newest = self.pending.pop();
            let mut index: usize = 0;
            self.pending.retain(|_| {
                index += 1;
                index.is_multiple_of(2)
            });
            self.pending.extend(newest);
        }
        self.reached
    }

    /// Whether a newer reading is waiting for transactions to end: read again soon.
    pub fn waiting(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(newest: i64, writing: &[&str]) -> Frontier {
        Frontier {
            newest,
            writing: writing.iter().map(|t| t.to_string()).collect(),
        }
    }

    #[test]
    fn with_no_writer_the_newest_sequence_is_the_watermark() {
        let mut mark = Watermark::default();
        assert_eq!(mark.observe(read(0, &[])), 0);
        assert_eq!(mark.observe(read(7, &[])), 7);
        assert!(!mark.waiting());
    }

    #[test]
    fn a_sequence_is_reached_once_every_writer_of_its_reading_has_ended() {
        let mut mark = Watermark::default();
        assert_eq!(mark.observe(read(10, &["3/1", "4/9"])), 0);
        assert!(mark.waiting());
        // 3/1 ended, 4/9 still writes, a new writer came: 10 is not reached, 12 is read.
        assert_eq!(mark.observe(read(12, &["4/9", "5/2"])), 0);
        // 4/9 ended: 10 is reached; 12 still waits for 5/2 (and 4/9 no longer).
        assert_eq!(mark.observe(read(12, &["5/2", "6/1"])), 10);
        assert_eq!(mark.observe(read(15, &["6/1"])), 12);
        assert_eq!(mark.observe(read(15, &[])), 15);
        assert!(!mark.waiting());
    }

    #[test]
    fn a_long_writer_keeps_the_readings_bounded_and_only_delays_the_watermark() {
        let mut mark = Watermark::default();
        for newest in 1..=10_000 {
            assert_eq!(
                mark.observe(read(newest, &["1/1", &format!("2/{newest}")])),
                0
            );
        }
        assert!(mark.pending.len() <= MAX_PENDING + 1);
        assert_eq!(mark.observe(read(10_000, &[])), 10_000);
    }
}

/// Other replicas' announcements that they committed events (PostgreSQL's LISTEN).
#[derive(Debug)]
pub struct Announcements {
    pub(crate) listener: sqlx::postgres::PgListener,
}

impl Announcements {
    /// How often a replica reads the store again when it hears no announcement: the bound on
    /// how late a watcher learns of an event whose announcement was lost, or of one written
    /// where nothing announces (another process on the same SQLite file).
    pub const POLL: std::time::Duration = std::time::Duration::from_millis(250);

    /// Waits for the next announcement. After the connection was lost (and made again) some
    /// may have been missed: that counts as one.
    pub async fn next(&mut self) -> Result<(), crate::StoreError> {
        self.listener.try_recv().await?;
        Ok(())
    }

    /// Takes an announcement already received, without waiting; whether there was one.
    pub fn pending(&mut self) -> bool {
        self.listener.next_buffered().is_some()
    }
}
