-- A lookup of one operation's rows (by tenant and operation id) must read the index keyed by the
-- operation, however little the planner knows of the tables.
--
-- Over an empty table, or one it has no statistics for yet, PostgreSQL costs every index that
-- leads with the tenant the same as the one keyed by tenant and operation id, and takes the
-- newest. A connection may keep that plan while the table fills (a prepared statement's generic
-- plan is made again only when the table's statistics change): a replica started on a new
-- database would then read every row of the tenant on every call, until the next ANALYZE.
--
-- So the indexes that order a tenant's rows (for listing, watching, forensics) are partial, on a
-- condition true of every row. A statement can use a partial index only when its own WHERE
-- clause says the condition, so only the statements written for these indexes, which say it, can
-- take them.

DROP INDEX operations_by_creation;
CREATE INDEX operations_by_creation ON operations (tenant, created_at, operation_id)
    WHERE created_at >= 0;

DROP INDEX events_by_tenant;
CREATE INDEX events_by_tenant ON events (tenant, sequence) WHERE sequence > 0;

DROP INDEX duplicates_by_tenant_time;
CREATE INDEX duplicates_by_tenant_time ON duplicates (tenant, at) WHERE at >= 0;
