//! The storage trait every backend implements.

use std::future::Future;

use once_core::{Attempt, Event, ListQuery, Millis, Operation, OperationId, Plan};

use crate::StoreError;

/// A database that can hold the ledger.
///
/// Writers go through a transaction: [`Backend::lock`] reads an operation and the clock while
/// excluding every other writer of that operation, [`Backend::apply`] writes a plan, and
/// [`Backend::commit`] makes it durable. Dropping a transaction rolls it back.
pub trait Backend: Clone + Send + Sync + 'static {
    type Tx: Send;

    /// A short name for logs: `sqlite` or `postgres`.
    fn kind(&self) -> &'static str;

    /// Starts a write transaction.
    fn begin_write(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Reads the operation for update (creating no row) and the store's clock.
    fn lock(
        &self,
        tx: &mut Self::Tx,
        tenant: &str,
        id: &OperationId,
    ) -> impl Future<Output = Result<(Option<Operation>, Millis), StoreError>> + Send;

    /// Reads the operation and the store's clock without taking any lock.
    fn read(
        &self,
        tenant: &str,
        id: &OperationId,
    ) -> impl Future<Output = Result<(Option<Operation>, Millis), StoreError>> + Send;

    /// The fresh-id guard: an UNKNOWN operation of the same tenant, tool and fingerprint under
    /// another id.
    fn find_blocking(
        &self,
        tx: &mut Self::Tx,
        op_tenant: &str,
        tool: &str,
        fingerprint: &[u8; 32],
        except: &OperationId,
    ) -> impl Future<Output = Result<Option<OperationId>, StoreError>> + Send;

    /// Writes a plan. An insert that meets an existing row fails with [`StoreError::Duplicate`].
    fn apply(
        &self,
        tx: &mut Self::Tx,
        tenant: &str,
        id: &OperationId,
        plan: &Plan,
        now: Millis,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    fn commit(&self, tx: Self::Tx) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The attempt log and event history of one operation, oldest first.
    fn history(
        &self,
        tenant: &str,
        id: &OperationId,
    ) -> impl Future<Output = Result<(Vec<Attempt>, Vec<Event>), StoreError>> + Send;

    /// One page of operations, oldest first, and the store's clock.
    fn list(
        &self,
        tenant: &str,
        query: &ListQuery,
    ) -> impl Future<Output = Result<Vec<Operation>, StoreError>> + Send;

    /// Up to `limit` IN_FLIGHT operations whose lease has ended, by the store's clock.
    fn expired_leases(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<(String, OperationId)>, StoreError>> + Send;

    /// Claims up to `limit` UNKNOWN operations due for a reconciler lookup, for `claim_ms`: no
    /// other caller sees them due until the claim lapses or a verdict reschedules them.
    fn claim_lookups(
        &self,
        limit: u32,
        claim_ms: i64,
    ) -> impl Future<Output = Result<Vec<(String, OperationId)>, StoreError>> + Send;

    /// Deletes up to `limit` settled operations past retention; returns how many.
    fn delete_expired(&self, limit: u32) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes up to `limit` events older than `age_ms`; returns how many.
    fn delete_events_older_than(
        &self,
        age_ms: i64,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Checks that the database answers.
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Closes the pool: waits for checked-out connections to return, then closes them.
    fn close(&self) -> impl Future<Output = ()> + Send;
}
