-- once-ledger schema (PostgreSQL). Times are milliseconds since the Unix epoch.
-- Keyed by tenant first, so it can be hash-partitioned. created_at is when the current life of the
-- operation id began: a settled operation past retention starts a new life on its next Begin.

CREATE TABLE operations (
    tenant           TEXT    NOT NULL,
    operation_id     TEXT    NOT NULL,
    tool             TEXT    NOT NULL,
    fingerprint      BYTEA   NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ('ABSENT', 'IN_FLIGHT', 'CONFIRMED', 'UNKNOWN')),
    source           TEXT    NOT NULL,
    attempt          BIGINT NOT NULL,
    attempt_id       TEXT    NOT NULL,
    lease_started_at BIGINT NOT NULL,
    lease_deadline   BIGINT NOT NULL,
    result           BYTEA,
    provider_ref     TEXT,
    provider_key     TEXT    NOT NULL,
    provider         TEXT,
    lookup_hints     TEXT,
    retention_ms     BIGINT NOT NULL,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    expires_at       BIGINT,
    reason           TEXT,
    resolution_id    TEXT,
    PRIMARY KEY (tenant, operation_id)
);

-- The fresh-id guard: UNKNOWN operations by tool and fingerprint.
CREATE INDEX operations_unknown_by_fingerprint ON operations (tenant, tool, fingerprint) WHERE state = 'UNKNOWN';
-- The lease sweeper.
CREATE INDEX operations_in_flight_by_deadline ON operations (lease_deadline) WHERE state = 'IN_FLIGHT';
-- The retention sweeper.
CREATE INDEX operations_settled_by_expiry ON operations (expires_at) WHERE expires_at IS NOT NULL;
-- ListOperations, oldest first.
CREATE INDEX operations_by_creation ON operations (tenant, created_at, operation_id);

CREATE TABLE attempts (
    tenant         TEXT    NOT NULL,
    operation_id   TEXT    NOT NULL,
    number         BIGINT NOT NULL,
    attempt_id     TEXT    NOT NULL,
    started_at     BIGINT NOT NULL,
    lease_deadline BIGINT NOT NULL,
    actor          TEXT    NOT NULL,
    client_name    TEXT,
    session_id     TEXT,
    request_id     TEXT,
    PRIMARY KEY (tenant, operation_id, number),
    FOREIGN KEY (tenant, operation_id) REFERENCES operations (tenant, operation_id) ON DELETE CASCADE
);

CREATE TABLE events (
    sequence     BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant       TEXT    NOT NULL,
    operation_id TEXT    NOT NULL,
    at           BIGINT NOT NULL,
    kind         TEXT    NOT NULL,
    from_state   TEXT,
    to_state     TEXT,
    attempt      BIGINT,
    actor        TEXT    NOT NULL,
    reason       TEXT,
    details      TEXT,
    dedupe_key   TEXT
);

CREATE INDEX events_by_operation ON events (tenant, operation_id, sequence);
CREATE INDEX events_by_time ON events (at);
CREATE UNIQUE INDEX events_once ON events (tenant, operation_id, dedupe_key) WHERE dedupe_key IS NOT NULL;
