"""notify waiting callers when a step or a saga finishes (PostgreSQL LISTEN/NOTIFY)

Revision ID: 0003
Revises: 0002
Create Date: 2027-01-10 10:00:00

The triggers ``pg_notify('sagaworker', saga_id)`` inside the transaction that moves an
entry to an outcome (any phase but INTENT and AWAITING_APPROVAL) or a saga to a terminal
status, so the notification goes out exactly when that change commits. ``Step.result``,
``Saga.wait`` and ``sw.saga`` listen on that channel (``sagaworker/_notify.py``) and poll
when the triggers are missing. Only those transitions notify: every notifying commit
takes PostgreSQL's notify-queue lock, so the step path pays it once per step (the outcome
commit), never on its INTENT or claim. SQLite has no LISTEN: nothing to do there.
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0003'
down_revision: str | Sequence[str] | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FUNCTION = """
CREATE OR REPLACE FUNCTION sagaworker_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('sagaworker', NEW.saga_id);
    RETURN NULL;
END
$$
"""
_ENTRIES = """
CREATE TRIGGER sagaworker_entries_notify
AFTER UPDATE OF phase ON sagaworker_entries
FOR EACH ROW
WHEN (NEW.phase IS DISTINCT FROM OLD.phase
      AND NEW.phase NOT IN ('INTENT', 'AWAITING_APPROVAL'))
EXECUTE FUNCTION sagaworker_notify()
"""
_SAGAS = """
CREATE TRIGGER sagaworker_sagas_notify
AFTER UPDATE OF status ON sagaworker_sagas
FOR EACH ROW
WHEN (NEW.status IS DISTINCT FROM OLD.status
      AND NEW.status IN ('COMPLETED', 'COMPENSATED', 'COMPENSATION_FAILED'))
EXECUTE FUNCTION sagaworker_notify()
"""


def _postgresql() -> bool:
    return bool(op.get_bind().dialect.name == 'postgresql')


def upgrade() -> None:
    if not _postgresql():
        return
    op.execute(_FUNCTION)
    op.execute('DROP TRIGGER IF EXISTS sagaworker_entries_notify ON sagaworker_entries')
    op.execute(_ENTRIES)
    op.execute('DROP TRIGGER IF EXISTS sagaworker_sagas_notify ON sagaworker_sagas')
    op.execute(_SAGAS)


def downgrade() -> None:
    if not _postgresql():
        return
    op.execute('DROP TRIGGER IF EXISTS sagaworker_sagas_notify ON sagaworker_sagas')
    op.execute('DROP TRIGGER IF EXISTS sagaworker_entries_notify ON sagaworker_entries')
    op.execute('DROP FUNCTION IF EXISTS sagaworker_notify()')
