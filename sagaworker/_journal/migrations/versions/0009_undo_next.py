"""an undo's outcome and the next undo's claim in one round trip (PostgreSQL)

Revision ID: 0009
Revises: 0008
Create Date: 2027-06-01 10:00:00

``sagaworker_undo_next(...)``: the compensation chain's common step as one call. It locks
the saga row (COMPENSATING), checks the outcome lands on the undo this chain holds, that
nothing holds the chain back (a forward attempt or another undo with a lease, a replayed
move's decisions) and that another EXECUTED step waits for its undo; then it journals the
outcome (numbered in the report) and claims the latest-EXECUTED undo, returning that
entry. Each statement of a plpgsql function reads a fresh snapshot, so the checks after
the lock see what committed before it (a single SQL statement would not). In any other
case it writes nothing and returns no row: the caller takes the full path
(``UndoMoves.record_and_claim``), which handles every case. SQLite: nothing to do.
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0009'
down_revision: str | Sequence[str] | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FUNCTION = """
CREATE OR REPLACE FUNCTION sagaworker_undo_next(
    p_saga text, p_seq integer, p_result text, p_detail text, p_attempts integer,
    p_token text, p_next text, p_lease double precision, p_worker text)
RETURNS SETOF sagaworker_entries
LANGUAGE plpgsql ROWS 1 AS $$
DECLARE
    v_order integer;
    v_next integer;
BEGIN
    PERFORM 1 FROM sagaworker_sagas
     WHERE saga_id = p_saga AND status = 'COMPENSATING' FOR UPDATE;
    IF NOT FOUND THEN RETURN; END IF;
    PERFORM 1 FROM sagaworker_entries
     WHERE saga_id = p_saga AND seq = p_seq AND compensation IS NULL
       AND undo_token = p_token FOR UPDATE;
    IF NOT FOUND THEN RETURN; END IF;
    PERFORM 1 FROM sagaworker_entries
     WHERE saga_id = p_saga AND seq <> p_seq
       AND ((phase = 'INTENT' AND lease_until IS NOT NULL)
            OR (phase = 'EXECUTED' AND compensation IS NULL
                AND comp_lease_until IS NOT NULL)
            OR decided_by = p_next);
    IF FOUND THEN RETURN; END IF;
    SELECT seq INTO v_next FROM sagaworker_entries
     WHERE saga_id = p_saga AND phase = 'EXECUTED' AND compensation IS NULL
       AND seq <> p_seq
     ORDER BY exec_order DESC LIMIT 1;
    IF v_next IS NULL THEN RETURN; END IF;
    UPDATE sagaworker_sagas
       SET comp_counter = comp_counter + 1, chain_touched_at = statement_timestamp(),
           updated_at = statement_timestamp(), resends = 0, resend_at = NULL
     WHERE saga_id = p_saga RETURNING comp_counter INTO v_order;
    UPDATE sagaworker_entries
       SET compensation = p_result, compensation_detail = p_detail,
           compensated_at = statement_timestamp(), comp_lease_until = NULL,
           comp_order = v_order, compensation_attempts = p_attempts,
           updated_at = statement_timestamp()
     WHERE saga_id = p_saga AND seq = p_seq;
    RETURN QUERY
    UPDATE sagaworker_entries
       SET compensation_attempts = compensation_attempts + 1,
           comp_lease_until = statement_timestamp()
                              + make_interval(secs => p_lease),
           comp_worker = p_worker, undo_token = p_next,
           updated_at = statement_timestamp()
     WHERE saga_id = p_saga AND seq = v_next
    RETURNING *;
END
$$
"""


def _postgresql() -> bool:
    return bool(op.get_bind().dialect.name == 'postgresql')


def upgrade() -> None:
    if _postgresql():
        op.execute(_FUNCTION)


def downgrade() -> None:
    if _postgresql():
        op.execute('DROP FUNCTION IF EXISTS sagaworker_undo_next('
                   'text, integer, text, text, integer, text, text, double precision, text)')
