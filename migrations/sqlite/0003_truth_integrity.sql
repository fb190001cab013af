-- Truth integrity.
--
-- Fencing tokens come from one counter for the whole store, so a token is never issued twice for
-- an operation id, even after retention deletes a settled row and the id starts a new life; a
-- life is identified by the token of its first attempt. Tokens start above every attempt number
-- an earlier schema could have issued as a token.
--
-- The operation row also keeps what the next decision needs without another read: the latest
-- attempt's transport context (a regrant needs the same) and executor (reports are recorded
-- under it), a version that every write bumps (a lookup claimed before a change is stale), the
-- moments that bound when the effect could have been written (for the reconciler's settle
-- time), which attempt someone other than itself declared ABSENT, and the lookup claim.

CREATE TABLE fencing_tokens (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    last INTEGER NOT NULL
);
INSERT INTO fencing_tokens (id, last) VALUES (1, 1048575);

ALTER TABLE operations ADD COLUMN fencing_token INTEGER NOT NULL DEFAULT 0;
ALTER TABLE operations ADD COLUMN life INTEGER NOT NULL DEFAULT 1;
ALTER TABLE operations ADD COLUMN client_name TEXT;
ALTER TABLE operations ADD COLUMN session_id TEXT;
ALTER TABLE operations ADD COLUMN request_id TEXT;
ALTER TABLE operations ADD COLUMN executor TEXT NOT NULL DEFAULT 'executor:default';
ALTER TABLE operations ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
ALTER TABLE operations ADD COLUMN unknown_since INTEGER;
ALTER TABLE operations ADD COLUMN last_report_at INTEGER;
ALTER TABLE operations ADD COLUMN declared_absent_token INTEGER;
ALTER TABLE operations ADD COLUMN confirmed_by INTEGER;
ALTER TABLE operations ADD COLUMN lookup_claimed_until INTEGER;
ALTER TABLE attempts ADD COLUMN fencing_token INTEGER NOT NULL DEFAULT 0;
ALTER TABLE events ADD COLUMN life INTEGER NOT NULL DEFAULT 1;

-- Rows written before: the token of attempt n was n, and the life began with token 1.
UPDATE attempts SET fencing_token = number;
UPDATE operations SET
    fencing_token = attempt,
    unknown_since = CASE WHEN state = 'UNKNOWN' THEN updated_at END,
    client_name = (SELECT a.client_name FROM attempts a WHERE a.tenant = operations.tenant
                   AND a.operation_id = operations.operation_id AND a.number = operations.attempt),
    session_id = (SELECT a.session_id FROM attempts a WHERE a.tenant = operations.tenant
                  AND a.operation_id = operations.operation_id AND a.number = operations.attempt),
    request_id = (SELECT a.request_id FROM attempts a WHERE a.tenant = operations.tenant
                  AND a.operation_id = operations.operation_id AND a.number = operations.attempt),
    executor = COALESCE((SELECT a.actor FROM attempts a WHERE a.tenant = operations.tenant
                         AND a.operation_id = operations.operation_id AND a.number = operations.attempt),
                        'executor:default');

UPDATE operations SET confirmed_by = attempt WHERE state = 'CONFIRMED' AND source = 'attempt';

-- A retried Resolve finds its RESOLVED event by dedupe key now, however the operation moved on.
-- Earlier resolutions get theirs (the latest, where one id resolved twice).
UPDATE events SET dedupe_key = 'RESOLVED:' || json_extract(details, '$.resolution_id')
WHERE kind = 'RESOLVED' AND dedupe_key IS NULL AND json_extract(details, '$.resolution_id') IS NOT NULL
  AND NOT EXISTS (
    SELECT 1 FROM events later
    WHERE later.tenant = events.tenant AND later.operation_id = events.operation_id
      AND later.kind = 'RESOLVED' AND later.sequence > events.sequence
      AND json_extract(later.details, '$.resolution_id') = json_extract(events.details, '$.resolution_id'));
ALTER TABLE operations DROP COLUMN resolution_id;

-- The fresh-id guard also stops a new id while the same intent is IN_FLIGHT.
DROP INDEX operations_unknown_by_fingerprint;
CREATE INDEX operations_open_by_fingerprint ON operations (tenant, tool, fingerprint)
    WHERE state IN ('UNKNOWN', 'IN_FLIGHT');

-- An operation's history is the events of its current life.
DROP INDEX events_by_operation;
CREATE INDEX events_by_operation ON events (tenant, operation_id, life, sequence);
