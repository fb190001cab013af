-- The first credential closes the ledger, and is created by a conditional write: one made on
-- the word of a caller admitted while the ledger was open carries `while_open = 1`, which the
-- unique index allows once, so of concurrent first credentials exactly one is stored. A ledger
-- that already holds credentials is closed: its first one takes the mark.

ALTER TABLE credentials ADD COLUMN while_open INTEGER CHECK (while_open = 1);
UPDATE credentials SET while_open = 1
    WHERE key_id = (SELECT key_id FROM credentials ORDER BY created_at, key_id LIMIT 1);
CREATE UNIQUE INDEX credentials_one_while_open ON credentials (while_open);
