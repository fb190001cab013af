-- Continuity (see once_core::continuity): noticing that the ledger was restored to an earlier
-- state, from what clients saw.
--
-- The ledger's identity and the key that seals the positions it hands clients, made once by the
-- first replica to start (an INSERT that one wins). They travel with the database: a restored
-- ledger still knows the positions it issued, a new database is another ledger.
CREATE TABLE ledger_identity (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    ledger     TEXT    NOT NULL,
    seal_key   TEXT    NOT NULL,
    created_at BIGINT NOT NULL
);

-- Each tenant's epoch, opened by every accepted loss, and whether its executions are held: since
-- when, and what a client showed (its epoch and token, the operation it was granted to) against
-- what the ledger held (its epoch and the highest token issued). No row: epoch 0, not held.
CREATE TABLE continuity (
    tenant        TEXT    PRIMARY KEY,
    epoch         BIGINT NOT NULL,
    held_since    BIGINT,
    why           TEXT,
    client_epoch  BIGINT,
    client_token  BIGINT,
    operation_id  TEXT,
    ledger_epoch  BIGINT,
    ledger_token  BIGINT
);

-- Every loss an operator accepted: who, when, why, the epoch it opened and what was held.
CREATE TABLE continuity_accepts (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant        TEXT    NOT NULL,
    at            BIGINT NOT NULL,
    actor         TEXT    NOT NULL,
    reason        TEXT    NOT NULL,
    epoch         BIGINT NOT NULL,
    held_since    BIGINT,
    why           TEXT,
    client_epoch  BIGINT,
    client_token  BIGINT,
    operation_id  TEXT,
    ledger_epoch  BIGINT,
    ledger_token  BIGINT
);

CREATE INDEX continuity_accepts_by_tenant ON continuity_accepts (tenant, at);
