-- Tenants and the credentials bound to them.
--
-- A credential is an API key or a client certificate, stored only as the SHA-256 of its secret
-- bytes. Once a credential exists (revoked or not), the ledger requires one from every caller.

CREATE TABLE tenants (
    name                TEXT   PRIMARY KEY,
    created_at          INTEGER NOT NULL,
    -- The most IN_FLIGHT operations the tenant may hold at once; NULL for no cap.
    max_in_flight       INTEGER,
    -- The most requests per second each of its credentials may send; NULL for no cap.
    requests_per_second INTEGER
);

CREATE TABLE credentials (
    key_id      TEXT   PRIMARY KEY,
    tenant      TEXT   NOT NULL REFERENCES tenants (name),
    name        TEXT   NOT NULL,
    roles       TEXT   NOT NULL,
    kind        TEXT   NOT NULL CHECK (kind IN ('key', 'certificate')),
    secret_hash BLOB   NOT NULL UNIQUE,
    created_at  INTEGER NOT NULL,
    revoked_at  INTEGER
);

CREATE INDEX credentials_by_tenant ON credentials (tenant, created_at);

-- A tenant's live operations, for its in-flight cap.
CREATE INDEX operations_in_flight_by_tenant ON operations (tenant) WHERE state = 'IN_FLIGHT';
