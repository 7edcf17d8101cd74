"""The awaitable twins of ``Sagaworker``'s calls that wait (part of ``Sagaworker``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._base.types import ApprovalRequest, SagaRecord
from .._journal.app_tx import split_connection
from .._producer.aio import offload
from .._producer.saga import Saga, in_app_tx

if TYPE_CHECKING:
    from .._runtime import Runtime

__all__ = ["AsyncTwins"]


class AsyncTwins:
    """``abegin``, ``astart``, ``aget``, ``ainspect``, ``aapprove``, ``areject``,
    ``apending_approvals``: the blocking part off the event loop (``aio``)."""

    if TYPE_CHECKING:  # what Sagaworker has
        rt: Runtime

        def begin(self, saga_id: str, *, metadata: dict[str, Any] | None = None,
                  deadline: float | None = None, connection: Any = None) -> Saga: ...

        def start(self, saga_id: str, flow: Callable[..., Any], /, *args: Any,
                  metadata: dict[str, Any] | None = None, deadline: float | None = None,
                  **kwargs: Any) -> Saga: ...

        def get(self, saga_id: str) -> Saga: ...

        def inspect(self, saga_id: str) -> SagaRecord: ...

        def approve(self, token: str, *, approver: str) -> None: ...

        def reject(self, token: str, *, approver: str, reason: str) -> None: ...

        def pending_approvals(self) -> list[ApprovalRequest]: ...

    async def abegin(self, saga_id: str, *, metadata: dict[str, Any] | None = None,
                     deadline: float | None = None, connection: Any = None) -> Saga:
        """``begin``, awaitable (the journal write off the event loop); ``connection=``
        an AsyncConnection or AsyncSession."""
        if connection is not None:
            return await in_app_tx(self.rt, connection, lambda c: self.begin(
                saga_id, metadata=metadata, deadline=deadline, connection=c))
        return await offload(self.begin, saga_id, metadata=metadata, deadline=deadline)

    async def aget(self, saga_id: str) -> Saga:
        """``get``, awaitable."""
        return await offload(self.get, saga_id)

    async def astart(self, saga_id: str, flow: Callable[..., Any], /, *args: Any,
                     metadata: dict[str, Any] | None = None, deadline: float | None = None,
                     **kwargs: Any) -> Saga:
        """``start``, awaitable (the journal write off the event loop); ``connection=``
        an AsyncConnection or AsyncSession."""
        connection = split_connection(kwargs)
        if connection is not None:
            return await in_app_tx(self.rt, connection, lambda c: self.start(
                saga_id, flow, *args, metadata=metadata, deadline=deadline, connection=c,
                **kwargs))
        return await offload(lambda: self.start(saga_id, flow, *args, metadata=metadata,
                                                deadline=deadline, **kwargs))

    async def ainspect(self, saga_id: str) -> SagaRecord:
        """``inspect``, awaitable."""
        return await offload(self.inspect, saga_id)

    async def aapprove(self, token: str, *, approver: str) -> None:
        """``approve``, awaitable."""
        await offload(self.approve, token, approver=approver)

    async def areject(self, token: str, *, approver: str, reason: str) -> None:
        """``reject``, awaitable."""
        await offload(self.reject, token, approver=approver, reason=reason)

    async def apending_approvals(self) -> list[ApprovalRequest]:
        """``pending_approvals``, awaitable."""
        return await offload(self.pending_approvals)
