-- One cycle on a fresh operation, the hand-rolled way: claim it, then confirm it, each
-- statement its own (autocommit) transaction.
\set n random(1, 9000000000000000000)
INSERT INTO hand_rolled_operations (tenant, operation_id, tool, fingerprint, state, attempt_id) VALUES ('default', 'op-' || :client_id || '-' || :n, 'issue_refund', '\x9f86d081884c7d65'::bytea, 'IN_FLIGHT', 'attempt-' || :n) ON CONFLICT DO NOTHING;
UPDATE hand_rolled_operations SET state = 'CONFIRMED', result = '\x7b7d'::bytea, provider_ref = 're_1', updated_at = now() WHERE tenant = 'default' AND operation_id = 'op-' || :client_id || '-' || :n AND state = 'IN_FLIGHT';
