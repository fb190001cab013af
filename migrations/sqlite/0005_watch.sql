-- Watching: every event names the operation's tool and the state the operation was in once the
-- event was recorded, so a watcher can filter the stream without reading operations (which
-- retention may have deleted since). Writers hold SQLite's one write lock from the start of
-- their transaction to its commit, so events commit in the order of their sequence.

ALTER TABLE events ADD COLUMN tool TEXT;
ALTER TABLE events ADD COLUMN state TEXT;

UPDATE events SET tool = (SELECT o.tool FROM operations o
                          WHERE o.tenant = events.tenant AND o.operation_id = events.operation_id);
UPDATE events SET state = to_state WHERE to_state IS NOT NULL;

-- A tenant's events in order: what a watcher reads.
CREATE INDEX events_by_tenant ON events (tenant, sequence);
