//! What a watcher reads: the frontier of committed events, a scope's wanted events in a range of
//! sequences, the horizon retention has deleted through, and the announcements replicas make
//! after their commits (see [`crate::watch`]).

use once_core::{OperationEvent, Scope, WatchFilter};
use sqlx::{Decode, Encode, Executor, FromRow, IntoArguments, Type};

use super::{Binds, Store};
use crate::backend::Events;
use crate::rows::{self, WatchedEventRow, WATCHED_EVENT_COLUMNS};
use crate::watch::Frontier;
use crate::{Announcements, Dialect, StoreError};

impl<D> Events for Store<D>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'q> i64: Encode<'q, D> + Decode<'q, D> + Type<D>,
    for<'r> WatchedEventRow: FromRow<'r, D::Row>,
    for<'r> (i64,): FromRow<'r, D::Row>,
    for<'r> (i64, String): FromRow<'r, D::Row>,
{
    async fn deleted_through(&self) -> Result<i64, StoreError> {
        let (through,): (i64,) =
            sqlx::query_as("SELECT deleted_through FROM event_horizon WHERE id = 1")
                .fetch_one(&self.pool)
                .await?;
        Ok(through)
    }

    async fn event_frontier(&self) -> Result<Frontier, StoreError> {
        let (newest, writing): (i64, String) =
            sqlx::query_as(D::frontier()).fetch_one(&self.pool).await?;
        Ok(Frontier {
            newest,
            writing: writing
                .split(',')
                .filter(|t| !t.is_empty())
                .map(str::to_owned)
                .collect(),
        })
    }

    async fn watch_events(
        &self,
        scope: &Scope,
        (after, upto): (i64, i64),
        filter: &WatchFilter,
        limit: u32,
    ) -> Result<Vec<OperationEvent>, StoreError> {
        // Declared before the arguments, which borrow it as long as they live.
        let mut sql = String::new();
        let mut binds = Binds::<D>::default();
        sql += &format!(
            // `sequence > 0`: see `list`.
            "SELECT {} FROM events WHERE sequence > 0 AND sequence > {} AND sequence <= {}",
            WATCHED_EVENT_COLUMNS.as_str(),
            binds.push(after)?,
            binds.push(upto)?,
        );
        if let Some(tenant) = scope.tenant() {
            sql += &format!(" AND tenant = {}", binds.push(tenant)?);
        }
        // The rule of `WatchFilter::matches`: states and kinds widen, the tool narrows.
        let mut wide = Vec::new();
        if !filter.states.is_empty() {
            let states = filter
                .states
                .iter()
                .map(|state| binds.push(state.as_str()))
                .collect::<Result<Vec<_>, _>>()?
                .join(", ");
            for column in ["from_state", "to_state", "state"] {
                wide.push(format!("{column} IN ({states})"));
            }
        }
        if !filter.kinds.is_empty() {
            let kinds = filter
                .kinds
                .iter()
                .map(|kind| binds.push(kind.as_str()))
                .collect::<Result<Vec<_>, _>>()?
                .join(", ");
            wide.push(format!("kind IN ({kinds})"));
        }
        if !wide.is_empty() {
            sql += &format!(" AND ({})", wide.join(" OR "));
        }
        if let Some(tool) = &filter.tool {
            sql += &format!(" AND tool = {}", binds.push(tool.as_str())?);
        }
        let limit = binds.push(i64::from(limit))?;
        sql += &format!(" ORDER BY sequence LIMIT {limit}");
        let page: Vec<WatchedEventRow> = sqlx::query_as_with(&sql, binds.arguments)
            .fetch_all(&self.pool)
            .await?;
        rows::convert(page)
    }

    async fn announce_events(&self) -> Result<(), StoreError> {
        D::announce_events(&self.pool).await
    }

    async fn listen_for_events(&self) -> Result<Option<Announcements>, StoreError> {
        D::listen_for_events(&self.pool).await
    }
}
