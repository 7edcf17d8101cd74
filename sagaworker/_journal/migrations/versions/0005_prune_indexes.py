"""retention finds the sagas to keep (an in-doubt entry) by a partial index

Revision ID: 0005
Revises: 0004
Create Date: 2027-02-15 10:00:00

A prune keeps every saga with an in-doubt entry unless told otherwise. With no index on
``in_doubt`` each batch of 1,000 sagas read the whole entries table to find the few
in-doubt rows: on a 10^7-row journal the prune ran at 752 sagas/s (7,516 entries/s),
against 13,000 sagas/s on a 10^5-row one; with this index and one query per status, 19,700
sagas/s (``python -m bench --brokers "" --no-dbos --big 1000,10000000``,
docs/benchmarks.md). The partial index holds only the in-doubt rows, so it stays tiny and
is written only when a step goes in doubt (the step path's updates stay HOT). Building it
reads the entries table once under a lock that holds writers back (seconds per 10^7 rows):
run the upgrade in a quiet moment, or build it beforehand with
``CREATE INDEX CONCURRENTLY ix_sagaworker_entries_in_doubt ON sagaworker_entries (saga_id)
WHERE in_doubt IS true`` and the upgrade skips it.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | Sequence[str] | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if 'ix_sagaworker_entries_in_doubt' in {
            ix['name'] for ix in sa.inspect(op.get_bind()).get_indexes('sagaworker_entries')}:
        return  # built beforehand (CONCURRENTLY, on a busy journal)
    op.create_index('ix_sagaworker_entries_in_doubt', 'sagaworker_entries', ['saga_id'],
                    postgresql_where=sa.text('in_doubt IS true'),
                    sqlite_where=sa.text('in_doubt IS 1'))


def downgrade() -> None:
    op.drop_index('ix_sagaworker_entries_in_doubt', table_name='sagaworker_entries')
