-- Retention deletes CONFIRMED operations by expiry, and ABSENT ones (kept as tombstones for the
-- provider key window) by when they settled: each sweep reads only what it deletes, never the
-- tombstones still kept.
CREATE INDEX operations_confirmed_by_expiry ON operations (expires_at)
    WHERE state = 'CONFIRMED' AND expires_at IS NOT NULL;
CREATE INDEX operations_absent_by_settle ON operations (updated_at)
    WHERE state = 'ABSENT' AND expires_at IS NOT NULL;
DROP INDEX operations_settled_by_expiry;
