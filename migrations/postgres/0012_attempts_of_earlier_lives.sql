-- A life that ended ABSENT hands its provider key to the next life and keeps its attempts beside
-- that life's, so a report one of them sends late is judged, and recorded in the life it belongs
-- to. Attempt numbers start again at 1 in every life; the fencing token is never issued twice for
-- one id, so it keys the attempt log. An attempt's life is the token of the latest attempt 1 at
-- or below its own.
ALTER TABLE attempts DROP CONSTRAINT attempts_pkey;
ALTER TABLE attempts ADD PRIMARY KEY (tenant, operation_id, fencing_token);
