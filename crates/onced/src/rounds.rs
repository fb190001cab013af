//! The loop every background worker is: a round every interval until told to stop.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Runs `round` every `interval` until `stop`, the first at once: the loop every sweeper is. A
/// round that overruns delays the next rather than bunching them up; `stop` ends a round
/// midway.
pub async fn every<F, R>(interval: Duration, stop: &CancellationToken, round: F)
where
    F: FnMut() -> R,
    R: Future<Output = ()>,
{
    every_from(tokio::time::Instant::now(), interval, stop, round).await;
}

/// [`every`], the first round at `first`.
pub async fn every_from<F, R>(
    first: tokio::time::Instant,
    interval: Duration,
    stop: &CancellationToken,
    mut round: F,
) where
    F: FnMut() -> R,
    R: Future<Output = ()>,
{
    let mut ticks = tokio::time::interval_at(first, interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = round() => {}
        }
    }
}
