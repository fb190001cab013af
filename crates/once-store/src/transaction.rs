//! Write transactions, on a pooled connection or on the one connection a store keeps for them.
//!
//! A pooled connection goes back to the pool as its transaction ends, and sqlx tests every
//! connection it takes back with a round trip before anyone may take it again. Where the
//! database takes one writer at a time (SQLite), write transactions rather take turns on one
//! connection kept out of the pool: the next one starts at once on the connection the last
//! one left, and a second writer of the same process waits its turn here, not in the
//! database's busy handler.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool, TransactionManager};
use tokio::sync::{Mutex, OwnedMutexGuard};

/// Where a store's write transactions take their connection.
#[derive(Debug)]
pub(crate) enum Writes<D: Database> {
    /// A connection of the store's pool for each transaction.
    Pooled,
    /// The one connection in `kept`, taken from `pool` when there is none (at first, and after
    /// one failed to start a transaction).
    Kept {
        pool: Pool<D>,
        kept: Arc<Mutex<Option<PoolConnection<D>>>>,
    },
}

impl<D: Database> Clone for Writes<D> {
    fn clone(&self) -> Self {
        match self {
            Self::Pooled => Self::Pooled,
            Self::Kept { pool, kept } => Self::Kept {
                pool: pool.clone(),
                kept: kept.clone(),
            },
        }
    }
}

impl<D: Database> Writes<D> {
    /// Write transactions on one connection of their own, from `pool`.
    pub(crate) fn kept(pool: Pool<D>) -> Self {
        Self::Kept {
            pool,
            kept: Arc::default(),
        }
    }

    /// Starts a write transaction with `begin` (the database's default BEGIN when `None`).
    pub(crate) async fn begin(
        &self,
        pool: &Pool<D>,
        begin: Option<&'static str>,
    ) -> Result<WriteTx<D>, sqlx::Error> {
        let mut conn = match self {
            Self::Pooled => Held::Pooled(pool.acquire().await?),
            Self::Kept { pool, kept } => {
                let mut turn = kept.clone().lock_owned().await;
                if turn.is_none() {
                    *turn = Some(pool.acquire().await?);
                }
                Held::Kept(turn)
            }
        };
        if let Err(error) = D::TransactionManager::begin(&mut conn, begin.map(Into::into)).await {
            // A connection that cannot start a transaction is not kept for the next one.
            if let Held::Kept(turn) = &mut conn {
                turn.take();
            }
            return Err(error);
        }
        Ok(WriteTx { conn, open: true })
    }

    /// Gives the kept connection back to its pool, so the pool can close.
    pub(crate) async fn release(&self) {
        if let Self::Kept { kept, .. } = self {
            kept.lock().await.take();
        }
    }
}

/// The connection a write transaction runs on.
enum Held<D: Database> {
    Pooled(PoolConnection<D>),
    /// The kept connection, present while its turn is held.
    Kept(OwnedMutexGuard<Option<PoolConnection<D>>>),
}

impl<D: Database> Deref for Held<D> {
    type Target = D::Connection;

    fn deref(&self) -> &D::Connection {
        match self {
            Self::Pooled(conn) => conn,
            Self::Kept(turn) => turn.as_ref().expect("a kept connection during its turn"),
        }
    }
}

impl<D: Database> DerefMut for Held<D> {
    fn deref_mut(&mut self) -> &mut D::Connection {
        match self {
            Self::Pooled(conn) => conn,
            Self::Kept(turn) => turn.as_mut().expect("a kept connection during its turn"),
        }
    }
}

/// An open write transaction: its statements run on it through `&mut **tx`. Dropped before
/// [`WriteTx::commit`], it is rolled back (before anything else runs on its connection).
pub struct WriteTx<D: Database> {
    conn: Held<D>,
    open: bool,
}

impl<D: Database> std::fmt::Debug for WriteTx<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept = matches!(self.conn, Held::Kept(_));
        f.debug_struct("WriteTx")
            .field("kept", &kept)
            .field("open", &self.open)
            .finish()
    }
}

impl<D: Database> WriteTx<D> {
    /// Commits it.
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        D::TransactionManager::commit(&mut self.conn).await?;
        self.open = false;
        Ok(())
    }
}

impl<D: Database> Deref for WriteTx<D> {
    type Target = D::Connection;

    fn deref(&self) -> &D::Connection {
        &self.conn
    }
}

impl<D: Database> DerefMut for WriteTx<D> {
    fn deref_mut(&mut self) -> &mut D::Connection {
        &mut self.conn
    }
}

impl<D: Database> Drop for WriteTx<D> {
    fn drop(&mut self) {
        if self.open {
            // Queued on the connection: it runs before the connection's next statement, and
            // before a pooled connection is taken again.
            D::TransactionManager::start_rollback(&mut self.conn);
        }
    }
}
