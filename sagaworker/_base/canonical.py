"""The journal's JSON: what Celery's own JSON carries, stored in kombu's tagged form.

Arguments, results, metadata and a flow's values are what kombu's JSON serializer accepts
(``datetime``, ``date``, ``time``, ``Decimal``, ``UUID``, ``bytes`` and types registered
with ``kombu.utils.json.register_type``). The journal stores them as kombu writes them on
the wire (``{"__type__": "datetime", "__value__": "..."}``) and gives them back as kombu
decodes them, so a value reads the same from the journal as from a message. Digests and
size limits are taken over the canonical text (sorted keys, no NaN).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any

from kombu.utils.json import JSONEncoder as _KombuEncoder
from kombu.utils.json import object_hook as _kombu_hook

from .errors import BadInput

__all__ = ["RESERVED_KEY", "args_digest", "bad_argument", "canonical_args", "check_json",
           "check_text", "from_wire", "not_json", "storable", "to_wire"]

_NATIVE = (str, int, float, bool, type(None))


class _NotJSON(TypeError):
    def __init__(self, o: Any) -> None:
        super().__init__(type(o).__qualname__)
        self.type_name = _type_name(o)


def _type_name(o: Any) -> str:
    t = type(o)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


class _Encoder(_KombuEncoder):
    """kombu's encoder, naming the type it cannot encode."""

    def default(self, o: Any) -> Any:
        try:
            return super().default(o)  # type: ignore[no-untyped-call]
        except TypeError:
            raise _NotJSON(o) from None


def _dumps(value: Any) -> str:
    return json.dumps(value, cls=_Encoder, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False)


def canonical_args(args: Any, kwargs: Any) -> str:
    return _dumps([list(args), dict(kwargs)])


def args_digest(args: Any, kwargs: Any) -> str:
    return hashlib.sha256(canonical_args(args, kwargs).encode()).hexdigest()


def not_json(value: Any) -> str | None:
    """None when ``value`` can be journaled, else the type that cannot (``set``, ``nan``)."""
    try:
        _dumps(value)
    except _NotJSON as exc:
        return exc.type_name
    except ValueError:  # NaN or an infinity: JSON has no such number
        return "float (NaN or infinity)"
    except RecursionError:
        return "structure nested too deeply"
    except TypeError:  # keys that cannot be sorted (1 and "b"), a tuple as a key
        return "dict whose keys are not all str"
    try:
        return _tag_problem(value)
    except RecursionError:
        return "structure nested too deeply"


#: the one key of an encrypted journal value (``crypto.MARKER``): reserved in user data
RESERVED_KEY = "$sagaworker_enc"


def _tag_problem(value: Any) -> str | None:
    """What would journal but never read back: a dict shaped like kombu's type tag that
    kombu cannot decode (kombu raises on an unknown ``__type__``), a dict holding the
    encrypted-value key, a string with a NUL (PostgreSQL's JSON has no such character)."""
    t = type(value)
    if t is str:
        return "string with a NUL character" if "\x00" in value else None
    if t is dict:
        if len(value) == 2 and "__type__" in value and "__value__" in value:
            try:
                _kombu_hook(dict(value))
            except Exception:
                return "dict shaped like kombu's type tag ({'__type__', '__value__'})"
        if RESERVED_KEY in value:
            return f"dict with the key {RESERVED_KEY!r}, which the journal reserves"
        bad_key = next((k for k in value if isinstance(k, str) and "\x00" in k), None)
        if bad_key is not None:
            return "dict key with a NUL character"
        values: Any = value.values()
    elif t is list or t is tuple:
        values = value
    else:
        return None
    for v in values:
        bad = _tag_problem(v)
        if bad is not None:
            return bad
    return None


def check_json(value: Any, what: str) -> str:
    """Encode ``value`` as the journal stores it, or raise BadInput naming the type."""
    bad = not_json(value)
    if bad is not None:
        raise BadInput(
            f"{what} is not JSON: it holds a {bad}; pass and return what Celery's JSON "
            "carries (str, int, float, bool, None, list, dict, datetime, date, time, "
            "Decimal, UUID, or a type registered with kombu.utils.json.register_type), "
            "e.g. an id instead of an object")
    return _dumps(value)


def to_wire(value: Any) -> Any:
    """``value`` as stored: JSON-native data, kombu's tagged form for other types."""
    t = type(value)
    if t in _NATIVE:
        return value
    if t is list or t is tuple:
        return [to_wire(v) for v in value]
    if t is dict:
        return {k: to_wire(v) for k, v in value.items()}
    return json.loads(json.dumps(value, cls=_Encoder, allow_nan=False))


def from_wire(value: Any) -> Any:
    """A stored value as kombu decodes it (tagged datetimes, Decimals, UUIDs come back)."""
    t = type(value)
    if t is list:
        return [from_wire(v) for v in value]
    if t is dict:
        d = {k: from_wire(v) for k, v in value.items()}
        return _kombu_hook(d) if len(d) == 2 and "__type__" in d and "__value__" in d else d
    return value


def bad_argument(signature: inspect.Signature | None, args: Any, kwargs: Any) -> str | None:
    """``argument 'card' holds a set``: the first argument that cannot be journaled,
    named by its parameter (positional ones bound through ``signature``), or None."""
    names: list[str] = []
    if signature is not None:
        names = [p.name for p in signature.parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, value in enumerate(args):
        bad = not_json(value)
        if bad is not None:
            name = repr(names[i]) if i < len(names) else f"#{i + 1} (positional)"
            return f"argument {name} holds a {bad}"
    for key, value in dict(kwargs).items():
        bad = not_json(value)
        if bad is not None:
            return f"argument {key!r} holds a {bad}"
    return None


def check_size(encoded: str, what: str, limit: int) -> None:
    """Refuse a value whose JSON (``encoded``) is over ``limit`` bytes: the journal and
    every message would carry it (SAGAWORKER_MAX_ARGS_BYTES)."""
    size = len(encoded.encode())
    if size > limit:
        raise BadInput(
            f"{what} are {size} bytes, over the {limit}-byte limit "
            "(SAGAWORKER_MAX_ARGS_BYTES); pass a reference (an id, a URL) instead of the "
            "data; nothing was journaled")


def storable(text: str) -> str:
    """Free text (a reason) as the journal can hold it: a NUL written as ``\\x00``."""
    return text.replace("\x00", "\\x00")


def check_text(value: str | None, what: str) -> None:
    """A reason, an approver or an actor the journal can hold: no NUL character (which
    PostgreSQL refuses with a raw error)."""
    if value is not None and "\x00" in value:
        raise BadInput(f"{what} holds a NUL character; remove it (nothing was changed)")
