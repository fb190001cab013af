-- Written and deleted again by the health check once the disk refused a write: a write of
-- this size committing says there is room again.
CREATE TABLE disk_room (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    room BLOB NOT NULL
);
