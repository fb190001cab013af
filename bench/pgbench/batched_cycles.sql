-- A bound, not a ledger: the rows 64 Begin + Confirm cycles of fresh operations leave in onced's
-- own tables (the operation, its attempt, its CLAIMED and CONFIRMED events, every index onced
-- keeps), written as perfect group commit would write them: one multi-row statement per table
-- and one commit for all 64 claims, then the same for their confirmations. Nothing is read, no
-- claim is checked, no answer is made: no ledger can write this for less PostgreSQL CPU.
-- The benchmark runs it on onced's database, under a tenant no caller uses.
\set n random(1, 900000000000)
BEGIN;
INSERT INTO operations (tenant, operation_id, tool, fingerprint, state, source, attempt, attempt_id, lease_started_at, lease_deadline, provider_key, retention_ms, created_at, updated_at, fencing_token, executor)
SELECT 'bench-bound', 'op-' || :client_id || '-' || :n || '-' || g, 'issue_refund', '\x9f86d081884c7d659f86d081884c7d659f86d081884c7d659f86d081884c7d65'::bytea, 'IN_FLIGHT', 'attempt', 1, 'attempt-' || :n || '-' || g, 1, 9000000000000, 'refund-' || :n || '-' || g, 86400000, 1, 1, :n::bigint * 64 + g, 'executor'
FROM generate_series(1, 64) AS g;
INSERT INTO attempts (tenant, operation_id, number, attempt_id, started_at, lease_deadline, actor, fencing_token)
SELECT 'bench-bound', 'op-' || :client_id || '-' || :n || '-' || g, 1, 'attempt-' || :n || '-' || g, 1, 9000000000000, 'executor', :n::bigint * 64 + g
FROM generate_series(1, 64) AS g;
INSERT INTO events (tenant, operation_id, at, kind, to_state, attempt, actor, tool, state)
SELECT 'bench-bound', 'op-' || :client_id || '-' || :n || '-' || g, 1, 'CLAIMED', 'IN_FLIGHT', 1, 'executor', 'issue_refund', 'IN_FLIGHT'
FROM generate_series(1, 64) AS g;
COMMIT;
BEGIN;
UPDATE operations SET state = 'CONFIRMED', source = 'attempt', result = '\x7b7d'::bytea, provider_ref = 're_1', updated_at = 2, expires_at = 9000000000000, last_report_at = 2, version = version + 1
WHERE tenant = 'bench-bound' AND operation_id IN (SELECT 'op-' || :client_id || '-' || :n || '-' || g FROM generate_series(1, 64) AS g) AND state = 'IN_FLIGHT';
INSERT INTO events (tenant, operation_id, at, kind, from_state, to_state, attempt, actor, tool, state)
SELECT 'bench-bound', 'op-' || :client_id || '-' || :n || '-' || g, 2, 'CONFIRMED', 'IN_FLIGHT', 'CONFIRMED', 1, 'executor', 'issue_refund', 'CONFIRMED'
FROM generate_series(1, 64) AS g;
COMMIT;
