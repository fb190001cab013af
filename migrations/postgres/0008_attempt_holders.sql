-- The credential each attempt was granted to (its key id; NULL when granted to none: while the
-- ledger was open, or before holders were recorded). A fencing token is readable by anyone who
-- may read the operation, so only the holder reports for an attempt granted to a credential,
-- heartbeats its lease or is granted it again. On the operation row the holder counts only
-- beside the fencing token it was written with (`holder_token`): a writer that does not know
-- these columns leaves the previous attempt's holder behind, and it must not bind the next.

ALTER TABLE operations ADD COLUMN holder TEXT;
ALTER TABLE operations ADD COLUMN holder_token BIGINT;
ALTER TABLE attempts ADD COLUMN holder TEXT;
