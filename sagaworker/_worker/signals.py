"""What stops a flow's replay: a step without an outcome (``_Suspend``), or a step that
differs from its journal (``_Diverged``). Not errors of the flow's: base exceptions, so
no ``except Exception`` in the flow's code (or an agent framework's) swallows them."""

from __future__ import annotations

__all__ = ["_Diverged", "_Suspend"]


class _Suspend(BaseException):
    """The replay reached a step without an outcome: it stops here (not an error)."""


class _Diverged(BaseException):
    """The replay left its journal at step ``seq``: the journal holds ``journaled`` there,
    the code ``asked`` for something else (or did something else: ``detail`` says)."""

    def __init__(self, seq: int, journaled: str, asked: str, detail: str,
                 newer: bool = False) -> None:
        super().__init__(detail)
        self.seq, self.journaled, self.asked, self.detail = seq, journaled, asked, detail
        #: the journal holds a patch marker there that this code never asks for: written
        #: by newer code (a rolling deploy), not a mistake of this code's
        self.newer = newer

