"""Publishing: INTENT is committed before any message leaves; a refused publish is relayed."""

from __future__ import annotations

import dataclasses
import functools
import secrets
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .._base import digests
from .._base.canonical import (
    canonical_args,
    check_arguments,
    check_size,
    has_control,
    storable,
)
from .._base.errors import BadInput, SagaworkerError
from .._base.patches import PatchMarker, patch_id
from .._base.registry import ToolSpec
from .._base.types import ENVELOPE, Phase
from .._base.units import CallFor, Unit, is_unit, unit_input
from .._journal.app_tx import AppTx
from .._journal.reads import Claiming
from .._journal.repository import NewEntry
from .._machine.machine import new_token, worker_label
from .._observe import tracing
from .._observe.logging import get_logger
from .._observe.redact import redact_call
from .._runtime import Runtime
from .approvals import signer_for

__all__ = ["Hold", "Producer"]

log = get_logger()
#: which of the steps a flow's advance journals the worker keeps to run itself
Hold = Callable[[NewEntry], bool]


class Producer:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def resolve(self, tool: Any) -> ToolSpec:
        if isinstance(tool, CallFor):
            tool = tool.tool
        name = tool if isinstance(tool, str) else getattr(tool, "name", None)
        spec = self.rt.registry.tool(name) if isinstance(name, str) else None
        if spec is None:
            raise SagaworkerError(
                f"{tool!r} is not a sagaworker tool; decorate it with @sw.tool(...) and "
                "enqueue the decorated function")
        return spec

    def prepare(self, tool: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> NewEntry:
        if isinstance(tool, CallFor):  # a framework's tool call: its id journaled with it
            return dataclasses.replace(self.prepare(tool.tool, args, kwargs),
                                       call_id=tool.call_id)
        if isinstance(tool, Unit):  # run by the replay that journals it: no message
            return NewEntry(tool_name=tool.tool_name, args=[], kwargs={},
                            args_digest=self.digest([tool.name], unit_input(tool)),
                            queue=None,
                            task_id=str(uuid.uuid4()), gated=False)
        if isinstance(tool, PatchMarker):  # a flow's patch marker: no tool, no message
            return NewEntry(tool_name=tool.tool_name, args=[], kwargs={},
                            args_digest=self.digest([], {}), queue=None,
                            task_id=str(uuid.uuid4()), gated=False, marker=True)
        spec = self.resolve(tool)
        if ENVELOPE in kwargs:
            raise BadInput(f"{ENVELOPE!r} is a reserved keyword; rename the argument")
        if spec.signature is not None:
            try:
                spec.signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise BadInput(f"malformed arguments for tool {spec.name!r}: {exc}; call it "
                               f"as {spec.name}{spec.signature}") from exc
        check_arguments(spec.signature, args, kwargs, f"arguments of tool {spec.name!r}")
        encoded = canonical_args(args, kwargs)
        if spec.gated:
            # a gate that nobody could ever decide must not be journaled
            signer_for(self.rt.settings).check()
        check_size(encoded, f"arguments of tool {spec.name!r}",
                   self.rt.settings.max_args_bytes)
        return NewEntry(tool_name=spec.name, args=list(args), kwargs=dict(kwargs),
                        args_digest=self.digest(args, kwargs), queue=spec.queue,
                        task_id=str(uuid.uuid4()), gated=spec.gated,
                        approval_nonce=secrets.token_hex(16) if spec.gated else None)

    def digest(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        """The args digest journaled with a step (keyed when values are sealed)."""
        return digests.digest(self.rt.cipher, args, kwargs)

    def enqueue(self, saga_id: str, calls: Sequence[tuple[Any, Sequence[Any], dict[str, Any]]],
                *, expect_seq: int | None = None, seen: int | None = None,
                tx: AppTx | None = None, parent: str | None = None,
                hold: Hold | None = None) -> list[tuple[int, NewEntry]]:
        """Journal the steps (one transaction: ``tx``, the caller's, if given), then
        publish the ungated ones (once ``tx`` committed) but those ``hold`` keeps (the
        caller runs them: if it cannot, the relay publishes them). Traced: each in an
        enqueue span, the child of ``parent`` (the saga's journaled context) or of the
        current span."""
        if not self.rt.registry.validated:
            self.rt.registry.validate()
        new = [self.prepare(t, a, k) for t, a, k in calls]
        if hold is not None:  # (claimed by the statement that journals it, where it can)
            new = [dataclasses.replace(e, held=True, claim=Claiming(
                new_token(), worker_label(), self.rt.settings.lease_seconds))
                if not e.marker and hold(e) else e for e in new]
        spans = tracing.enqueue_spans(saga_id, [e.tool_name for e in new], parent)
        if spans is None:
            return self._journal(saga_id, new, expect_seq, seen, tx, None)
        new = [dataclasses.replace(e, trace_context=s.carrier) for e, s in zip(new, spans,
                                                                               strict=True)]
        try:
            done = self._journal(saga_id, new, expect_seq, seen, tx, spans)
            if not done:  # another replay journaled these steps first
                for s in spans:
                    s.outcome("superseded")
            return done
        except BaseException as exc:
            for s in spans:
                s.fail(exc)
            raise
        finally:
            for s in spans:
                s.end()

    def _journal(self, saga_id: str, new: list[NewEntry], expect_seq: int | None,
                 seen: int | None, tx: AppTx | None, spans: list[tracing.Spanned] | None
                 ) -> list[tuple[int, NewEntry]]:
        seqs = self.rt.machine.add_entries(saga_id, new, expect_seq=expect_seq, seen=seen,
                                           tx=tx)
        if not seqs:  # a flow's replay that found the journal moved on: nothing journaled
            return []
        for i, (e, seq) in enumerate(zip(new, seqs, strict=True)):
            s = tracing.NO_SPAN if spans is None else spans[i]
            s.set("seq", seq)
            if tx is None:
                with s.current():  # an instrumented Celery's publish span is its child
                    self._announce(saga_id, seq, e)
            else:
                tx.after_commit(functools.partial(self._announce_within, saga_id, seq, e),
                                saga_id=saga_id, task_ids=[e.task_id])
        return list(zip(seqs, new, strict=True))

    def enqueue_call(self, saga_id: str, call_id: str, tool: Any, args: Sequence[Any],
                     kwargs: dict[str, Any], parent: str | None = None
                     ) -> tuple[int, str, str]:
        """Journal one step for a caller's call id, unless the saga holds it already:
        ``(seq, task_id, tool)`` of the step for that id."""
        if not isinstance(call_id, str) or not call_id or len(call_id) > 200:
            raise BadInput(f"call id {call_id!r}: give a non-empty string of at most 200 "
                           "characters (the framework's tool-call id)")
        if has_control(call_id):
            raise BadInput(f"call id {call_id!r} holds a control character; nothing was "
                           "journaled")
        if not self.rt.registry.validated:
            self.rt.registry.validate()
        new = dataclasses.replace(self.prepare(tool, args, kwargs), call_id=call_id)
        with tracing.span(f"enqueue {new.tool_name}", parent=parent, kind="PRODUCER",
                          saga_id=saga_id, tool=new.tool_name) as s:
            if s.carrier is not None:
                new = dataclasses.replace(new, trace_context=s.carrier)
            found, created = self.rt.machine.add_call(saga_id, new)
            if created:
                s.set("seq", found)
                self._announce(saga_id, found, new)
                return found, new.task_id, new.tool_name
        if found.tool_name != new.tool_name or not digests.matches(
                self.rt.cipher, found.args_digest, args, kwargs, clear_ok=True):
            raise BadInput(
                f"call id {call_id!r} already journaled step {found.seq} of saga {saga_id!r} "
                f"({found.tool_name}) with other arguments; one call id names one call: "
                "nothing was journaled")
        if found.phase == Phase.INTENT.value and not found.attempts:
            # journaled by a call whose COMMIT reply was lost (it raised before its publish),
            # or still queued: sent again (a duplicate message is one claim that finds
            # the step taken), so the retry does not wait for the relay
            self.publish(saga_id, found.seq, found.tool_name, list(found.args or []),
                         dict(found.kwargs or {}), found.task_id, found.queue)
        return found.seq, found.task_id, found.tool_name

    def _announce_within(self, saga_id: str, seq: int, e: NewEntry) -> None:
        """``_announce`` after the app's COMMIT, under the step's journaled context."""
        with tracing.within(e.trace_context):
            self._announce(saga_id, seq, e)

    def _announce(self, saga_id: str, seq: int, e: NewEntry) -> None:
        """A journaled step's log lines, and its publish unless it waits at a gate."""
        if e.marker:
            log.info("flow_patch_marked", saga_id=saga_id, seq=seq, patch=patch_id(e.tool_name))
            return
        if is_unit(e.tool_name):
            log.info("step_intent", saga_id=saga_id, seq=seq, tool=e.tool_name,
                     task_id=e.task_id, unit=True)
            return
        log.info("step_intent", saga_id=saga_id, seq=seq, tool=e.tool_name,
                 task_id=e.task_id, **({"call_id": e.call_id} if e.call_id else {}),
                 **({"eager": True} if e.held else {}),
                 kwargs=redact_call(self.resolve(e.tool_name).signature, e.args, e.kwargs,
                                    self.rt.settings.redact_keys)[1])
        if e.gated:
            log.info("approval_requested", saga_id=saga_id, seq=seq, tool=e.tool_name,
                     approver=None)
        elif not e.held:
            self.publish(saga_id, seq, e.tool_name, e.args, e.kwargs, e.task_id, e.queue)

    def publish(self, saga_id: str, seq: int, tool: str, args: list[Any],
                kwargs: dict[str, Any], task_id: str, queue: str | None) -> bool:
        """Publish one tool message; on a refusal the outbox relay sends it later."""
        return self.rt.bus.publish_step(saga_id, seq, tool, args, kwargs, task_id, queue)

    def fail(self, saga_id: str, reason: str) -> None:
        reason = storable(reason)  # an error's text may hold anything
        self.rt.machine.request_failure(saga_id, reason)
        self.rt.bus.send_failure(saga_id, reason)
