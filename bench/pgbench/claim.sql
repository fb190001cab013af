-- The claim statement alone: its latency is what a Begin of a fresh operation is compared with.
\set n random(1, 9000000000000000000)
INSERT INTO hand_rolled_operations (tenant, operation_id, tool, fingerprint, state, attempt_id) VALUES ('default', 'claim-' || :client_id || '-' || :n, 'issue_refund', '\x9f86d081884c7d65'::bytea, 'IN_FLIGHT', 'attempt-' || :n) ON CONFLICT DO NOTHING;
