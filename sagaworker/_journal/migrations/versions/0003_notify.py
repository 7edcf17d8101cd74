"""notify waiting callers when a step or a saga finishes (PostgreSQL LISTEN/NOTIFY)

Revision ID: 0003
Revises: 0002
Create Date: 2027-01-10 10:00:00

The triggers ``pg_notify('sagaworker', saga_id)`` inside the transaction that moves an
entry to an outcome (any phase but INTENT and AWAITING_APPROVAL) or a saga to a terminal
status, so the notification goes out exactly when that change commits, and only when
somebody waits on that saga: a row in the UNLOGGED table ``sagaworker_waiters``, which
``Step.result``, ``Saga.wait`` and ``sw.saga`` write before they wait (they listen on the
channel, ``sagaworker/_notify.py``, and poll when this migration is missing). Every
notifying commit holds PostgreSQL's cluster-wide notify lock until it is durable, so
notifying commits do not group-commit; steps nobody waits on never take it.
SQLite has no LISTEN: nothing to do there.
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0003'
down_revision: str | Sequence[str] | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_WAITERS = """
CREATE UNLOGGED TABLE IF NOT EXISTS sagaworker_waiters (
    saga_id VARCHAR(200) NOT NULL,
    waiter VARCHAR(100) NOT NULL,
    since TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    PRIMARY KEY (saga_id, waiter)
)
"""
_FUNCTION = """
CREATE OR REPLACE FUNCTION sagaworker_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM sagaworker_waiters w WHERE w.saga_id = NEW.saga_id) THEN
        PERFORM pg_notify('sagaworker', NEW.saga_id);
    END IF;
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
    op.execute(_WAITERS)
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
    op.execute('DROP TABLE IF EXISTS sagaworker_waiters')
