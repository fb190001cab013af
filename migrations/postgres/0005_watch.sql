-- Watching: every event names the operation's tool and the state the operation was in once the
-- event was recorded, so a watcher can filter the stream without reading operations (which
-- retention may have deleted since).
--
-- A watcher resumes after the sequence of the last event it received. Sequences are handed out
-- in time order but committed in any order, so a replica sends only events up to a sequence
-- below which nothing can still commit: every write transaction holds a shared advisory lock
-- (the write gate) from its first statement to its end, and the replica waits until every
-- transaction that held it when it read the newest sequence has ended.

ALTER TABLE events ADD COLUMN tool TEXT;
ALTER TABLE events ADD COLUMN state TEXT;

UPDATE events SET tool = o.tool FROM operations o
WHERE o.tenant = events.tenant AND o.operation_id = events.operation_id;
UPDATE events SET state = to_state WHERE to_state IS NOT NULL;

-- A tenant's events in order: what a watcher reads.
CREATE INDEX events_by_tenant ON events (tenant, sequence);
