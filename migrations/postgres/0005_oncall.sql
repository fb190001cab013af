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

-- The argument needs sequences handed out in time order across sessions: no per-session cache.
ALTER TABLE events ALTER COLUMN sequence SET CACHE 1;

-- A tenant's events in order: what a watcher reads.
CREATE INDEX events_by_tenant ON events (tenant, sequence);

-- Forensics: every Begin answered without a new execution right (a replay, IN_PROGRESS,
-- UNKNOWN, CONFLICT, the same grant again), with the transport context that carried it, so that
-- repeated calls can be told apart: a retry, a reconnect, a re-issue. Recorded in batches after
-- the answer, and kept as long as events.
CREATE TABLE duplicates (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant       TEXT   NOT NULL,
    operation_id TEXT   NOT NULL,
    tool         TEXT   NOT NULL,
    at           BIGINT NOT NULL,
    decision     TEXT   NOT NULL,
    attempt_id   TEXT   NOT NULL,
    client_name  TEXT,
    session_id   TEXT,
    request_id   TEXT,
    actor        TEXT   NOT NULL,
    -- The id the caller asked for, when the fresh-id guard answered for this operation.
    requested_id TEXT
);

CREATE INDEX duplicates_by_operation ON duplicates (tenant, operation_id, at);
CREATE INDEX duplicates_by_tenant_time ON duplicates (tenant, at);
CREATE INDEX duplicates_by_time ON duplicates (at);

-- The highest event sequence retention has deleted: a watcher resuming below it would miss
-- what was deleted, and is told so instead.
CREATE TABLE event_horizon (
    id              INTEGER PRIMARY KEY CHECK (id = 1),
    deleted_through BIGINT  NOT NULL
);
INSERT INTO event_horizon (id, deleted_through) VALUES (1, 0);
