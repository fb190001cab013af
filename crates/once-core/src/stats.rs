//! What on-call staff and dashboards count: operations by state and tool, how long UNKNOWN ones
//! have waited, how long UNKNOWN took to resolve by each door, and the anomalies — from rows the
//! store reads, summed here.

use crate::model::{EventKind, Millis, State};

/// Durations summed up: how many, and their percentiles (nearest rank) and maximum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ages {
    pub count: usize,
    pub p50: Millis,
    pub p90: Millis,
    pub p99: Millis,
    pub max: Millis,
}

impl Ages {
    pub fn of(mut durations: Vec<Millis>) -> Self {
        if durations.is_empty() {
            return Ages::default();
        }
        durations.sort_unstable();
        let rank = |p: usize| {
            let n = durations.len();
            let index = (p * n).div_ceil(100).clamp(1, n) - 1;
            durations[index]
        };
        Ages {
            count: durations.len(),
            p50: rank(50),
            p90: rank(90),
            p99: rank(99),
            max: *durations.last().expect("not empty"),
        }
    }
}

/// The three ways out of UNKNOWN (SPEC §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Door {
    /// A late report from the attempt that held the lease.
    LateReport,
    /// A reconciler's verdict.
    Reconciler,
    /// An operator's resolution.
    Operator,
}

impl Door {
    pub const ALL: [Door; 3] = [Door::LateReport, Door::Reconciler, Door::Operator];

    /// The door an event out of UNKNOWN went through.
    pub fn of(kind: EventKind) -> Option<Door> {
        match kind {
            EventKind::Confirmed | EventKind::ReportedAbsent => Some(Door::LateReport),
            EventKind::Reconciled => Some(Door::Reconciler),
            EventKind::Resolved => Some(Door::Operator),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Door::LateReport => "late_report",
            Door::Reconciler => "reconciler",
            Door::Operator => "operator",
        }
    }
}

/// A tenant's figures: now, and over a window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// How many operations are in each state, by tool, now.
    pub operations: Vec<(State, String, i64)>,
    /// How long the UNKNOWN operations have been UNKNOWN, now.
    pub unknown: Ages,
    /// For each door, how long operations that left UNKNOWN through it in the window had been
    /// UNKNOWN.
    pub resolved: Vec<(Door, Ages)>,
    /// How many anomalies and escalations were recorded in the window, by kind.
    pub events: Vec<(EventKind, i64)>,
}

/// The kinds [`Stats::events`] counts.
pub const COUNTED: [EventKind; 3] = [
    EventKind::DoubleExecution,
    EventKind::ResolutionContradicted,
    EventKind::Escalated,
];

impl Stats {
    /// Sums what the store read: the counts, the ages of the UNKNOWN operations, and each
    /// event out of UNKNOWN in the window with how long the operation had been UNKNOWN.
    pub fn of(
        operations: Vec<(State, String, i64)>,
        unknown_ages: Vec<Millis>,
        resolutions: Vec<(EventKind, Millis)>,
        events: Vec<(EventKind, i64)>,
    ) -> Self {
        let resolved = Door::ALL
            .into_iter()
            .map(|door| {
                let took = resolutions
                    .iter()
                    .filter(|(kind, _)| Door::of(*kind) == Some(door))
                    .map(|(_, took)| *took)
                    .collect();
                (door, Ages::of(took))
            })
            .collect();
        let events = COUNTED
            .into_iter()
            .map(|kind| {
                let n = events
                    .iter()
                    .filter(|(k, _)| *k == kind)
                    .map(|(_, n)| *n)
                    .sum();
                (kind, n)
            })
            .collect();
        Stats {
            operations,
            unknown: Ages::of(unknown_ages),
            resolved,
            events,
        }
    }
}

/// The ages a gauge of UNKNOWN operations counts at or past, in milliseconds: 0 (all of them),
/// a minute, 5 and 15 minutes, an hour, 6 hours, a day.
pub const UNKNOWN_AGE_THRESHOLDS: [Millis; 7] = [
    0, 60_000, 300_000, 900_000, 3_600_000, 21_600_000, 86_400_000,
];

/// What the whole store holds now, across tenants, for a replica's gauges: every replica reads
/// the same figures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gauges {
    /// How many operations are open (IN_FLIGHT or UNKNOWN), by state, tenant and tool.
    pub open: Vec<(State, String, String, i64)>,
    /// For each tenant with UNKNOWN operations and each of [`UNKNOWN_AGE_THRESHOLDS`], how many
    /// of its UNKNOWN operations have been UNKNOWN at least that long (none listed: none).
    pub unknown_older_than: Vec<(String, Millis, i64)>,
    /// For each tenant with UNKNOWN operations, how long its oldest has been UNKNOWN.
    pub oldest_unknown: Vec<(String, Millis)>,
    /// IN_FLIGHT operations whose lease has ended (the lease sweeper has yet to move them).
    pub past_lease: i64,
    /// Every tenant the store knows, so per-tenant series exist (at 0) before their first
    /// event: a counter's first sample would otherwise be its first increase, unseen.
    pub tenants: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        assert_eq!(Ages::of(vec![]), Ages::default());
        let one = Ages::of(vec![7]);
        assert_eq!((one.count, one.p50, one.p99, one.max), (1, 7, 7, 7));
        let hundred = Ages::of((1..=100).rev().collect());
        assert_eq!(
            (hundred.p50, hundred.p90, hundred.p99, hundred.max),
            (50, 90, 99, 100)
        );
        let ten = Ages::of((1..=10).collect());
        assert_eq!((ten.p50, ten.p90, ten.p99), (5, 9, 10));
    }

    #[test]
    fn resolutions_are_counted_by_their_door() {
        let stats = Stats::of(
            vec![(State::Unknown, "refund".into(), 2)],
            vec![1_000, 60_000],
            vec![
                (EventKind::Confirmed, 500),
                (EventKind::Reconciled, 2_000),
                (EventKind::Reconciled, 4_000),
                (EventKind::Resolved, 600_000),
            ],
            vec![(EventKind::Escalated, 3)],
        );
        assert_eq!(stats.unknown.max, 60_000);
        let counts: Vec<(Door, usize, Millis)> = stats
            .resolved
            .iter()
            .map(|(door, ages)| (*door, ages.count, ages.max))
            .collect();
        assert_eq!(
            counts,
            [
                (Door::LateReport, 1, 500),
                (Door::Reconciler, 2, 4_000),
                (Door::Operator, 1, 600_000)
            ]
        );
        assert_eq!(
            stats.events,
            [
                (EventKind::DoubleExecution, 0),
                (EventKind::ResolutionContradicted, 0),
                (EventKind::Escalated, 3)
            ]
        );
    }
}
