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
    /// Each reconciler's lookups in the window, by name.
    pub lookups: Vec<Lookups>,
}

/// One reconciler's lookups over a window: what they found, and how long they took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lookups {
    pub reconciler: String,
    /// Lookups that settled their operation, CONFIRMED or ABSENT.
    pub settled: i64,
    /// Lookups that found nothing that proves absence yet: the operation stayed UNKNOWN.
    pub missed: i64,
    /// Lookups that could not tell: the provider failed, did not answer in time, or answered
    /// something the reconciler could not read.
    pub failed: i64,
    /// From a lookup's claim to its verdict's commit: the mean and the longest, in
    /// milliseconds (`None` when no lookup says).
    pub mean_ms: Option<Millis>,
    pub max_ms: Option<Millis>,
}

/// What the store reads of lookups: for one reconciler actor (`reconciler:NAME`), event kind
/// and finding, how many, and the mean and longest time from claim to commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupRow {
    pub actor: String,
    pub kind: EventKind,
    pub found: Option<String>,
    pub count: i64,
    pub mean_ms: Option<Millis>,
    pub max_ms: Option<Millis>,
}

impl Lookups {
    /// Each reconciler's figures from the rows the store read, by name.
    pub fn of(rows: Vec<LookupRow>) -> Vec<Lookups> {
        let mut by_name: std::collections::BTreeMap<String, (Lookups, i128, i64)> =
            std::collections::BTreeMap::new();
        for row in rows {
            let Some(name) = row.actor.strip_prefix("reconciler:") else {
                continue;
            };
            let (figures, total_ms, timed) = by_name.entry(name.to_owned()).or_insert_with(|| {
                let figures = Lookups {
                    reconciler: name.to_owned(),
                    ..Lookups::default()
                };
                (figures, 0, 0)
            });
            match (row.kind, row.found.as_deref()) {
                (EventKind::Reconciled, _) => figures.settled += row.count,
                (EventKind::LookupInconclusive, Some("ABSENT")) => figures.missed += row.count,
                (EventKind::LookupInconclusive, _) => figures.failed += row.count,
                _ => continue,
            }
            if let Some(mean) = row.mean_ms {
                *total_ms += i128::from(mean) * i128::from(row.count);
                *timed += row.count;
            }
            figures.max_ms = figures.max_ms.max(row.max_ms);
        }
        by_name
            .into_values()
            .map(|(mut figures, total_ms, timed)| {
                figures.mean_ms = (timed > 0)
                    .then(|| Millis::try_from(total_ms / i128::from(timed)).unwrap_or(Millis::MAX));
                figures
            })
            .collect()
    }
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
        lookups: Vec<LookupRow>,
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
            lookups: Lookups::of(lookups),
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
    fn lookups_are_counted_by_reconciler_and_finding_and_timed_by_their_mean() {
        let row = |actor: &str, kind, found: Option<&str>, count, mean, max| LookupRow {
            actor: actor.into(),
            kind,
            found: found.map(Into::into),
            count,
            mean_ms: mean,
            max_ms: max,
        };
        let figures = Lookups::of(vec![
            row(
                "reconciler:stripe",
                EventKind::Reconciled,
                Some("CONFIRMED"),
                3,
                Some(100),
                Some(300),
            ),
            row(
                "reconciler:stripe",
                EventKind::LookupInconclusive,
                Some("ABSENT"),
                1,
                Some(500),
                Some(500),
            ),
            row(
                "reconciler:stripe",
                EventKind::LookupInconclusive,
                Some("UNKNOWN"),
                2,
                None,
                None,
            ),
            // Before lookups said what they found: one that could not tell.
            row(
                "reconciler:adyen",
                EventKind::LookupInconclusive,
                None,
                1,
                Some(40),
                Some(40),
            ),
            row("operator:alice", EventKind::Reconciled, None, 7, None, None),
        ]);
        assert_eq!(
            figures,
            [
                Lookups {
                    reconciler: "adyen".into(),
                    failed: 1,
                    mean_ms: Some(40),
                    max_ms: Some(40),
                    ..Lookups::default()
                },
                Lookups {
                    reconciler: "stripe".into(),
                    settled: 3,
                    missed: 1,
                    failed: 2,
                    mean_ms: Some(200),
                    max_ms: Some(500),
                },
            ]
        );
        let stripe = &figures[1];
        assert_eq!(stripe.settled + stripe.missed + stripe.failed, 6);
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
            Vec::new(),
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
