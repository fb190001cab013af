-- A life that ended ABSENT hands its provider key to the next life and keeps its attempts beside
-- that life's, so a report one of them sends late is judged, and recorded in the life it belongs
-- to. Attempt numbers start again at 1 in every life; the fencing token is never issued twice for
-- one id, so it keys the attempt log. An attempt's life is the token of the latest attempt 1 at
-- or below its own. SQLite cannot change a primary key in place: the table is rebuilt.
CREATE TABLE attempts_by_token (
    tenant         TEXT    NOT NULL,
    operation_id   TEXT    NOT NULL,
    number         INTEGER NOT NULL,
    attempt_id     TEXT    NOT NULL,
    started_at     INTEGER NOT NULL,
    lease_deadline INTEGER NOT NULL,
    actor          TEXT    NOT NULL,
    client_name    TEXT,
    session_id     TEXT,
    request_id     TEXT,
    fencing_token  INTEGER NOT NULL,
    holder         TEXT,
    PRIMARY KEY (tenant, operation_id, fencing_token),
    FOREIGN KEY (tenant, operation_id) REFERENCES operations (tenant, operation_id) ON DELETE CASCADE
);
INSERT INTO attempts_by_token (tenant, operation_id, number, attempt_id, started_at,
    lease_deadline, actor, client_name, session_id, request_id, fencing_token, holder)
SELECT tenant, operation_id, number, attempt_id, started_at, lease_deadline, actor, client_name,
    session_id, request_id, fencing_token, holder
FROM attempts;
DROP TABLE attempts;
ALTER TABLE attempts_by_token RENAME TO attempts;
