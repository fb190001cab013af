-- Reconciliation: how often an UNKNOWN operation has been looked up at its provider, and when
-- it is next due (pushed ahead while a replica looks it up, so replicas never overlap).
ALTER TABLE operations ADD COLUMN reconcile_lookups INTEGER NOT NULL DEFAULT 0;
ALTER TABLE operations ADD COLUMN reconcile_next_at INTEGER;

CREATE INDEX operations_due_for_lookup ON operations (reconcile_next_at)
    WHERE state = 'UNKNOWN' AND provider IS NOT NULL;
