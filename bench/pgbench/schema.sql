-- The table a team starts with when it hand-rolls an idempotency ledger: one row per
-- operation, claimed by inserting it and confirmed by updating it. The benchmark runs
-- `claim_confirm.sql` over it with pgbench, beside onced on the same PostgreSQL.
DROP TABLE IF EXISTS hand_rolled_operations;
CREATE TABLE hand_rolled_operations (
    tenant       TEXT NOT NULL,
    operation_id TEXT NOT NULL,
    tool         TEXT NOT NULL,
    fingerprint  BYTEA NOT NULL,
    state        TEXT NOT NULL,
    attempt_id   TEXT NOT NULL,
    result       BYTEA,
    provider_ref TEXT,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, operation_id)
);
