-- The token counter follows every fencing token an operation row takes, so a write transaction
-- can read the next token (one more than the counter) with the operation it locks, in one
-- statement, and take it only by writing it: a token no row took is issued again, and one that
-- a committed row took never is, even after retention deletes the row. Writers hold the one
-- write lock from their first statement, so no two read the same counter.
CREATE TRIGGER operations_insert_keeps_token AFTER INSERT ON operations
WHEN NEW.fencing_token > (SELECT last FROM fencing_tokens WHERE id = 1)
BEGIN
    UPDATE fencing_tokens SET last = NEW.fencing_token WHERE id = 1;
END;

CREATE TRIGGER operations_update_keeps_token AFTER UPDATE OF fencing_token ON operations
WHEN NEW.fencing_token > (SELECT last FROM fencing_tokens WHERE id = 1)
BEGIN
    UPDATE fencing_tokens SET last = NEW.fencing_token WHERE id = 1;
END;
