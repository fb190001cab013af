-- One statement per write on the hot path.
--
-- A Begin or a report is decided from a lock-free read of the operation, then written by one
-- statement that commits by itself and checks that it was decided from what is still stored:
-- the row is still absent (its INSERT meets no row) or still at the version that was read (its
-- UPDATE names the version). A statement that finds the row changed writes nothing, and the
-- call is decided again under a lock.
--
-- A first claim also needs the fresh-id guard: no other open operation of the same intent. Its
-- lookup must see what the intent's previous holder committed before the intent's lock was
-- granted, so it cannot be part of the statement that takes the lock (one statement reads one
-- snapshot, taken before it waits). A VOLATILE function runs each query of its own with a new
-- snapshot: this one takes the intent's lock (held until the transaction ends), then looks.

CREATE FUNCTION once_blocking(intent BIGINT, of_tenant TEXT, of_tool TEXT, of_fingerprint BYTEA,
                              other_than TEXT)
RETURNS TABLE (operation_id TEXT, state TEXT, attempt BIGINT, lease_deadline BIGINT,
               updated_at BIGINT)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(intent);
    -- The same query as the guard of a locked Begin. UNKNOWN operations come first: they
    -- block whatever their lease says.
    RETURN QUERY
        SELECT o.operation_id, o.state, o.attempt, o.lease_deadline, o.updated_at
        FROM operations o
        WHERE o.tenant = of_tenant AND o.tool = of_tool AND o.fingerprint = of_fingerprint
          AND o.state IN ('UNKNOWN', 'IN_FLIGHT') AND o.operation_id <> other_than
        ORDER BY o.state DESC, o.created_at
        LIMIT 1;
END
$$;
