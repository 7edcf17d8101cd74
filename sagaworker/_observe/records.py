"""Journal records as people see them (the CLI, the JSON API, the dashboard): arguments
redacted by name, their values scrubbed out of free text. The journal keeps the real
values."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from .._base.canonical import canonical_args
from .._base.jsonable import plain
from .._base.types import ApprovalRequest, EntryRecord, Phase, SagaRecord, SagaResult
from .._base.units import model_turn, step_label, unit_kind
from .process import (
    redact_keys,
    signature_of,
)
from .redact import (
    REDACTED,
    Signature,
    _scrub_strings,
    redact_call,
    redact_value,
    scrub_text,
    secret_values,
)

__all__ = ["Redaction", "saga_json", "waiting_step"]

# -- records for people: the CLI, the JSON API, the dashboard ----------------------------


@dataclasses.dataclass(frozen=True)
class Redaction:
    """Redacts journal records for display. The journal itself keeps the real values."""

    keys: frozenset[str]
    lookup: Callable[[str], Signature | None] = signature_of
    #: a flow's signature without its FlowContext (None: its positional arguments are all
    #: redacted, the safe side)
    flow_lookup: Callable[[str], Signature | None] = lambda name: None
    #: the key of the fingerprints an approver sees of a gated step's redacted arguments
    #: (derived from the approval secret: every process that shows a gate holds it); None:
    #: a redacted value shows as ``[REDACTED]`` alone (a reader who is not an operator)
    fingerprint_key: bytes | None = None

    @classmethod
    def of(cls, sw: Any) -> Redaction:
        """The redaction of one ``Sagaworker``: its keys, its tools' and flows' signatures."""
        registry = sw.registry

        def lookup(name: str) -> Signature | None:
            spec = registry.tool(name)
            return spec.signature if spec is not None else signature_of(name)

        def flow_lookup(name: str) -> Signature | None:
            spec = getattr(sw, "flows", None) and sw.flows.specs.get(name)
            if not spec:
                return None
            try:
                sig = inspect.signature(spec.fn)
            except (TypeError, ValueError):
                return None
            return sig.replace(parameters=list(sig.parameters.values())[1:])

        secret = sw.settings.approval_secret
        first = secret.get_secret_value().split(",")[0].strip() if secret is not None else ""
        return cls(frozenset(sw.settings.redact_keys), lookup, flow_lookup,
                   fingerprint_key(first) if first else None)

    def unmarked(self) -> Redaction:
        """This redaction without fingerprints: what a reader who is not an operator sees
        (a mark shows a value's last characters, links the sagas that share it, and is an
        HMAC to try guesses of the approval secret against)."""
        return dataclasses.replace(self, fingerprint_key=None)

    @classmethod
    def current(cls) -> Redaction:
        """What this process was configured with (every ``Sagaworker`` it built)."""
        return cls(redact_keys())

    def values(self, e: EntryRecord | ApprovalRequest) -> list[str]:
        return secret_values(self.lookup(e.tool_name), e.args or [], e.kwargs or {},
                             self.keys)

    def entry(self, e: EntryRecord, values: list[str] | None = None) -> EntryRecord:
        e = _displayed(e)
        if not self.keys:
            return e
        vals = self.values(e) if values is None else values
        args, kwargs = redact_call(self.lookup(e.tool_name), e.args or [], e.kwargs or {},
                                   self.keys)
        return dataclasses.replace(
            e, args=args, kwargs=kwargs,
            result=_scrub_strings(redact_value(e.result, self.keys), vals),
            error=_text(e.error, vals), compensation_detail=_text(e.compensation_detail, vals),
            rejection_reason=_text(e.rejection_reason, vals))

    def record(self, rec: SagaRecord) -> SagaRecord:
        if not self.keys:
            return dataclasses.replace(
                rec, entries=[_displayed(e) for e in rec.entries],
                report=dataclasses.replace(
                    rec.report, in_doubt=[_displayed(e) for e in rec.report.in_doubt]))
        flow_args, flow_kwargs = rec.flow_args, rec.flow_kwargs
        flow_vals: list[str] = []
        if rec.flow is not None and (flow_args or flow_kwargs):
            sig = self.flow_lookup(rec.flow)
            flow_vals = secret_values(sig, flow_args or [], flow_kwargs or {}, self.keys)
            new_args, new_kwargs = redact_call(sig, flow_args or [], flow_kwargs or {},
                                               self.keys)
            flow_args = new_args if flow_args is not None else None
            flow_kwargs = new_kwargs if flow_kwargs is not None else None
        vals = _merge([flow_vals, *(self.values(e) for e in rec.entries)])
        report = dataclasses.replace(
            rec.report,
            outcomes=[dataclasses.replace(o, detail=_text(o.detail, vals))
                      for o in rec.report.outcomes],
            in_doubt=[self.entry(e, vals) for e in rec.report.in_doubt])
        return dataclasses.replace(rec, reason=_text(rec.reason, vals),
                                   flow_args=flow_args, flow_kwargs=flow_kwargs,
                                   metadata=redact_value(rec.metadata, self.keys),
                                   entries=[self.entry(e, vals) for e in rec.entries],
                                   report=report)

    def approval(self, a: ApprovalRequest) -> ApprovalRequest:
        """A gate for its approver: each redacted value shown as its last characters and
        a keyed fingerprint (``[REDACTED …1111 #3fa8c2d1]``), so the approver can tell
        which card is meant and compare it with what the requester sees, never reading
        the value (the fingerprint is an HMAC with a key derived from the approval secret:
        it cannot be looked up by trying every card number without the secret). Shown to
        operators only (``unmarked`` for anyone else)."""
        if not self.keys:
            return a
        args, kwargs = redact_call(self.lookup(a.tool_name), a.args, a.kwargs, self.keys)
        if self.fingerprint_key is not None:
            args = _marked(a.args, args, self.fingerprint_key)
            kwargs = _marked(a.kwargs, kwargs, self.fingerprint_key)
        return dataclasses.replace(a, args=args, kwargs=kwargs)

    def any(self, o: Any) -> Any:
        """Records (or lists of them) redacted; anything else as it is."""
        if isinstance(o, list | tuple):
            return [self.any(x) for x in o]
        if isinstance(o, SagaRecord):
            return self.record(o)
        if isinstance(o, EntryRecord):
            return self.entry(o)
        if isinstance(o, ApprovalRequest):
            return self.approval(o)
        if isinstance(o, SagaResult) and self.keys:
            return dataclasses.replace(o, value=redact_value(o.value, self.keys))
        return o


def fingerprint_key(secret: str) -> bytes:
    """The key of the fingerprints, derived from the approval secret (an HMAC of a fixed
    label): a fingerprint is never an HMAC made with the key that signs approvals."""
    return hmac.new(secret.encode(), b"sagaworker redacted-value fingerprint",
                    hashlib.sha256).digest()


def fingerprint(value: Any, key: bytes) -> str:
    """``[REDACTED …1111 #3fa8c2d1]``: a redacted value as an approver sees it."""
    digest = hmac.new(key, b"redacted|" + canonical_args([value], {}).encode(),
                      hashlib.sha256).hexdigest()[:8]
    text = str(value)
    tail = f"…{text[-4:]} " if len(text) >= 12 else ""  # (a short value: no part of it)
    return f"[REDACTED {tail}#{digest}]"


def _marked(original: Any, shown: Any, key: bytes) -> Any:
    """``shown`` (redacted) with each ``[REDACTED]`` marked with the fingerprint of the
    original value in its place."""
    if shown == REDACTED and original != REDACTED:
        return fingerprint(original, key)
    if isinstance(shown, dict) and isinstance(original, dict):
        return {k: _marked(original.get(k), v, key) for k, v in shown.items()}
    if isinstance(shown, list) and isinstance(original, list | tuple) and len(shown) == len(
            original):
        return [_marked(o, v, key) for o, v in zip(original, shown, strict=True)]
    return shown


def _displayed(e: EntryRecord) -> EntryRecord:
    """A model turn in its display form (the model, its tokens, the tools it asked for),
    never its whole response: a response quotes the conversation and the arguments of
    the calls the model asked for, kept as JSON strings (the OpenAI Agents SDK's), and a
    refused call's are in no step to scrub them with. The journal keeps the response."""
    turn = model_turn(e.tool_name, e.result)
    return e if turn is None or turn is e.result else dataclasses.replace(e, result=turn)


def _text(s: str | None, values: list[str]) -> str | None:
    return s if s is None else scrub_text(s, values)


def _merge(groups: Iterable[list[str]]) -> list[str]:
    return sorted({v for g in groups for v in g}, key=len, reverse=True)




def waiting_step(rec: SagaRecord) -> EntryRecord | None:
    """The step an open saga waits on: its first entry still INTENT or AWAITING_APPROVAL."""
    if rec.status.terminal:
        return None
    return next((e for e in rec.entries
                 if e.phase in (Phase.INTENT, Phase.AWAITING_APPROVAL)), None)


def saga_json(rec: SagaRecord, redaction: Redaction | None = None) -> dict[str, Any]:
    """The saga as JSON for people and clients (`sagaworker show --json`, the JSON API):
    redacted, with ``terminal``, ``dirty`` and ``waiting_on`` (the step it waits on)."""
    rec = (redaction or Redaction.current()).record(rec)
    d: dict[str, Any] = plain(rec)
    d["terminal"] = rec.status.terminal
    d["dirty"] = bool(rec.report.dirty)
    step = waiting_step(rec)
    d["waiting_on"] = None if step is None else {
        "seq": step.seq, "tool_name": step.tool_name, "phase": step.phase.value}
    for e, out in zip(rec.entries, d["entries"], strict=True):
        # its one name, and what kind of step it is (a tool's, an agent's model request,
        # a function tool's call)
        out["name"], out["kind"] = step_label(e.tool_name), unit_kind(e.tool_name) or "tool"
        turn = model_turn(e.tool_name, e.result)
        if turn is not None:  # an agent's model request: its model, tokens, tools asked
            out["model_turn"] = turn
    return d
