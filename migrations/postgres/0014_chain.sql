-- The history's chain (see once_core::chain): each tenant's events, linked in sequence order
-- once no event below them can still commit, into links that list a digest of each event and
-- carry the hash of the link before.
CREATE TABLE chain_links (
    tenant   TEXT NOT NULL,
    number   BIGINT NOT NULL,
    starts_after BIGINT NOT NULL,
    through  BIGINT NOT NULL,
    entries  TEXT NOT NULL,
    previous TEXT NOT NULL,
    hash     TEXT NOT NULL,
    at       BIGINT NOT NULL,
    PRIMARY KEY (tenant, number)
);

-- Retention cuts links by the sequences they cover.
CREATE INDEX chain_links_by_through ON chain_links (through);

-- How far the history is linked: every event with a sequence up to `through` is in a link of
-- its tenant. One replica at a time moves it (a write conditional on where it was).
CREATE TABLE chain_progress (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    through BIGINT NOT NULL
);
INSERT INTO chain_progress (id, through) VALUES (1, 0);

-- The latest verification of each tenant's chain, for the console and `oncectl verify`.
CREATE TABLE chain_verifications (
    tenant      TEXT PRIMARY KEY,
    at          BIGINT NOT NULL,
    through     BIGINT NOT NULL,
    links       BIGINT NOT NULL,
    events      BIGINT NOT NULL,
    problem     TEXT
);
