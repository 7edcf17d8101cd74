"""Part of ``Journal``: each saga's nonce, the place its values are sealed for on a journal
with keys (``sagas.place_nonce``), as this process last read it.

A one-statement write (``_machine.pgfast``: an INTENT, an EXECUTED, a flow's completion)
seals its values before the statement runs, so it must know the saga's nonce first:
remembered from the saga's creation, its claims and its locked reads, read once otherwise.
A nonce never changes; a saga id used again after a prune has another one: every such
statement writes only while the nonce it sealed for is still the saga's (else it misses,
and the locked path, which reads it, writes).
"""

from __future__ import annotations

from sqlalchemy import Engine, select

from .._base.crypto import cipher_for
from . import pgconn
from .schema import sagas

__all__ = ["SagaNonces"]

#: the most nonces remembered (each is read again when needed)
_MAX = 10_000


class SagaNonces:
    engine: Engine
    _nonces: dict[str, str | None]

    @property
    def keyed(self) -> bool:
        """Values are sealed on this journal (its sagas get nonces)."""
        return cipher_for(self.engine) is not None

    def nonce_of(self, saga_id: str) -> str | None:
        """The saga's nonce (None: it has none, or no such saga), remembered or read."""
        if saga_id not in self._nonces:
            with self.engine.connect() as conn:
                self.note_nonce(saga_id, conn.execute(
                    select(sagas.c.place_nonce).where(sagas.c.saga_id == saga_id)).scalar())
        return self._nonces.get(saga_id)

    def place(self, saga_id: str) -> pgconn.Place | None:
        """What a one-statement write seals values for on a journal with keys (the saga's
        nonce as this process knows it: the statement checks it still is); else None."""
        return pgconn.Place(self.nonce_of(saga_id)) if self.keyed else None

    def note_nonce(self, saga_id: str, nonce: str | None) -> None:
        if len(self._nonces) >= _MAX:
            self._nonces.clear()
        self._nonces[saga_id] = nonce

    def forget_nonce(self, saga_id: str) -> None:
        self._nonces.pop(saga_id, None)
