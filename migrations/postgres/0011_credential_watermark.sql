-- Credentials and tenants carry the version of the change that last wrote them, drawn from one
-- counter that each such change advances in its own transaction. The counter's row is held
-- until that transaction ends, so changes commit in version order: a replica that has read
-- every change through version V reads, on its next refresh, only what has a higher one.
CREATE TABLE credential_clock (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version BIGINT  NOT NULL
);
INSERT INTO credential_clock (id, version) VALUES (1, 0);
ALTER TABLE credentials ADD COLUMN changed BIGINT NOT NULL DEFAULT 0;
ALTER TABLE tenants ADD COLUMN changed BIGINT NOT NULL DEFAULT 0;
CREATE INDEX credentials_by_change ON credentials (changed);
CREATE INDEX tenants_by_change ON tenants (changed);
