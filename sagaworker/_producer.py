"""Publishing: INTENT is committed before any message leaves; a refused publish is relayed."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._canonical import args_digest, canonical_args
from ._errors import BadInput, SagaworkerError
from ._execution import ENVELOPE
from ._journal import NewEntry
from ._logging import get_logger
from ._redact import call_reprs, redact_call
from ._saga import Step

if TYPE_CHECKING:
    from ._core import Sagaworker
    from ._registry import ToolSpec

__all__ = ["Producer"]

log = get_logger()

#: kombu publish retry policy: ride out a broker restart instead of failing the step
RETRY_POLICY = {"max_retries": 5, "interval_start": 0.2, "interval_step": 0.5,
                "interval_max": 2.0}


class Producer:
    def __init__(self, sw: Sagaworker) -> None:
        self.sw = sw

    def resolve(self, tool: Any) -> ToolSpec:
        name = tool if isinstance(tool, str) else getattr(tool, "name", None)
        spec = self.sw.registry.tool(name) if isinstance(name, str) else None
        if spec is None:
            raise SagaworkerError(
                f"{tool!r} is not a sagaworker tool; decorate it with @sw.tool(...) and "
                "enqueue the decorated function")
        return spec

    def prepare(self, tool: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> NewEntry:
        spec = self.resolve(tool)
        if ENVELOPE in kwargs:
            raise BadInput(f"{ENVELOPE!r} is a reserved keyword; rename the argument")
        if spec.signature is not None:
            try:
                spec.signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise BadInput(f"malformed arguments for tool {spec.name!r}: {exc}; call it "
                               f"as {spec.name}{spec.signature}") from exc
        try:
            encoded = canonical_args(args, kwargs)
        except (TypeError, ValueError) as exc:
            raise BadInput(
                f"arguments of tool {spec.name!r} are not JSON ({exc}); pass only JSON types "
                "(str, int, float, bool, None, list, dict with str keys)") from exc
        limit = self.sw.settings.max_args_bytes
        if len(encoded.encode()) > limit:
            raise BadInput(
                f"arguments of tool {spec.name!r} are {len(encoded.encode())} bytes, over "
                f"the {limit}-byte limit (SAGAWORKER_MAX_ARGS_BYTES); pass a reference "
                "(an id, a URL) instead of the data")
        return NewEntry(tool_name=spec.name, args=list(args), kwargs=dict(kwargs),
                        args_digest=args_digest(args, kwargs), queue=spec.queue,
                        task_id=str(uuid.uuid4()), gated=spec.gated,
                        approval_nonce=secrets.token_hex(16) if spec.gated else None)

    def enqueue(self, saga_id: str,
                calls: Sequence[tuple[Any, Sequence[Any], dict[str, Any]]]) -> list[Step]:
        self.sw.ensure_valid()
        new = [self.prepare(t, a, k) for t, a, k in calls]
        seqs = self.sw.journal.add_entries(saga_id, new)
        steps = []
        for e, seq in zip(new, seqs, strict=True):
            log.info("step_intent", saga_id=saga_id, seq=seq, tool=e.tool_name,
                     task_id=e.task_id,
                     kwargs=redact_call(self.resolve(e.tool_name).signature, e.args, e.kwargs,
                                        self.sw.settings.redact_keys)[1])
            if e.gated:
                log.info("approval_requested", saga_id=saga_id, seq=seq, tool=e.tool_name,
                         approver=None)
            else:
                self.publish(saga_id, seq, e.tool_name, e.args, e.kwargs, e.task_id, e.queue)
            steps.append(Step(self.sw, saga_id, seq, e.task_id, e.tool_name))
        return steps

    def publish(self, saga_id: str, seq: int, tool: str, args: list[Any],
                kwargs: dict[str, Any], task_id: str, queue: str | None) -> bool:
        """Publish one tool message; on a refusal the outbox relay sends it later."""
        spec = self.sw.registry.tool(tool)
        if spec is None:
            return False
        options: dict[str, Any] = {"task_id": task_id, "retry": True,
                                   "retry_policy": RETRY_POLICY}
        if queue:
            options["queue"] = queue
        try:
            real = {**kwargs, ENVELOPE: {"saga_id": saga_id, "seq": seq}}
            argsrepr, kwargsrepr = call_reprs(spec.signature, args, real,
                                              self.sw.settings.redact_keys)
            spec.task.apply_async(args=list(args), kwargs=real, argsrepr=argsrepr,
                                  kwargsrepr=kwargsrepr, **options)
        except Exception as exc:  # the broker refused or is down: INTENT stays, relay resends
            log.error("step_publish_failed", saga_id=saga_id, seq=seq, tool=tool,
                      task_id=task_id, error=f"{type(exc).__name__}: {exc}")
            return False
        return True

    def fail(self, saga_id: str, reason: str) -> None:
        self.sw.journal.request_failure(saga_id, reason)
        self.sw.send_failure(saga_id, reason)
