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

__all__ = ["RESERVED_KEY", "args_digest", "bad_argument", "canonical_args", "check_arguments",
           "check_json", "check_text", "from_wire", "has_control", "not_json", "oversize",
           "storable", "to_wire", "unheld_result", "unstorable"]

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


def not_json(value: Any, *, strict: bool = False) -> str | None:
    """None when ``value`` can be journaled, else the type that cannot (``set``, ``nan``).
    ``strict`` (a producer's input): a dict shaped like kombu's type tag is refused even
    when kombu decodes it, as it would read back as another type than the caller gave."""
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
        return _tag_problem(value, strict)
    except RecursionError:
        return "structure nested too deeply"


#: the one key of an encrypted journal value (``crypto.MARKER``): reserved in user data
RESERVED_KEY = "$sagaworker_enc"


#: what a dict holding the encrypted-value key, or shaped like kombu's type tag, is called
RESERVED_DICT = f"dict with the key {RESERVED_KEY!r}, which the journal reserves"
TAG_DICT = "dict shaped like kombu's type tag ({'__type__', '__value__'})"
#: problems a key's name makes: renaming the key is the fix
_KEY_PROBLEMS = (RESERVED_DICT, TAG_DICT, "dict key with a NUL character",
                 "dict key with a lone surrogate (not valid Unicode)")
_RENAME = ("rename the key (the journal would read the value back as something else); "
           "nothing was journaled")


def has_control(text: str) -> bool:
    """Whether ``text`` holds a control character: C0 (a NUL, a line break), DEL or C1
    (U+0080 to U+009F: NEL, a terminal's CSI), which an id must not (a terminal showing
    the id would act on it)."""
    return any(ch < " " or "\x7f" <= ch <= "\x9f" for ch in text)


def unstorable(text: str) -> str | None:
    """What in ``text`` no journal can hold (PostgreSQL refuses a NUL, and UTF-8 a lone
    surrogate: both raw errors), or None."""
    if "\x00" in text:
        return "a NUL character"
    try:
        text.encode()
    except UnicodeEncodeError:
        return "a lone surrogate (not valid Unicode)"
    return None


def _is_tag(d: dict[Any, Any]) -> bool:
    return len(d) == 2 and "__type__" in d and "__value__" in d


def _dict_problem(d: dict[Any, Any], strict: bool) -> str | None:
    """What in this dict's own keys would journal but not read back as this dict."""
    if _is_tag(d):
        if strict:
            return TAG_DICT
        try:
            _kombu_hook(dict(d))
        except Exception:
            return TAG_DICT
    if RESERVED_KEY in d:
        return RESERVED_DICT
    for k in d:
        bad = unstorable(k) if isinstance(k, str) else None
        if bad is not None:
            return f"dict key with {bad}"
    return None


def _tag_problem(value: Any, strict: bool = False) -> str | None:
    """What would journal but never read back: a dict shaped like kombu's type tag that
    kombu cannot decode (any, when ``strict``), a dict holding the encrypted-value key, a
    string with a NUL (PostgreSQL's JSON has no such character). A dict subclass counts as
    a dict (JSON writes it as one)."""
    t = type(value)
    if t is str:
        bad = unstorable(value)
        return None if bad is None else f"string with {bad}"
    if isinstance(value, dict):
        bad = _dict_problem(value, strict)
        if bad is not None:
            return bad
        values: Any = value.values()
    elif t is list or t is tuple:
        values = value
    else:
        return None
    for v in values:
        bad = _tag_problem(v, strict)
        if bad is not None:
            return bad
    return None


def check_json(value: Any, what: str, *, strict: bool = False) -> str:
    """Encode ``value`` as the journal stores it, or raise BadInput naming the type (or
    the key to rename; ``strict`` as for ``not_json``)."""
    bad = not_json(value, strict=strict)
    if bad in _KEY_PROBLEMS:
        raise BadInput(f"{what} cannot be journaled: it holds a {bad}; {_RENAME}")
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


def from_wire(value: Any, *, container: bool = False) -> Any:
    """A stored value as kombu decodes it (tagged datetimes, Decimals, UUIDs come back).
    ``container``: the value is a dict by construction (kwargs, metadata), so its own keys
    are never taken for a type tag, only the values in it."""
    t = type(value)
    if t is list:
        return [from_wire(v) for v in value]
    if t is dict:
        d = {k: from_wire(v) for k, v in value.items()}
        return _kombu_hook(d) if not container and _is_tag(d) else d
    return value


def bad_argument(signature: inspect.Signature | None, args: Any, kwargs: Any) -> str | None:
    """``argument 'card' holds a set``: the first argument that cannot be journaled (or
    would read back as something else: a producer's input is checked strictly), named by
    its parameter (positional ones bound through ``signature``), or None. Keyword names
    come first: the kwargs are one dict, and its keys could make it a type tag or an
    encrypted value."""
    names_bad = _keyword_problem(dict(kwargs))
    if names_bad is not None:
        return names_bad
    names: list[str] = []
    if signature is not None:
        names = [p.name for p in signature.parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, value in enumerate(args):
        bad = not_json(value, strict=True)
        if bad is not None:
            name = repr(names[i]) if i < len(names) else f"#{i + 1} (positional)"
            return f"argument {name} holds a {bad}"
    for key, value in dict(kwargs).items():
        bad = not_json(value, strict=True)
        if bad is not None:
            return f"argument {key!r} holds a {bad}"
    return None


def _keyword_problem(kwargs: dict[str, Any]) -> str | None:
    """The keyword names that would make the kwargs read back as something else."""
    bad = _dict_problem(kwargs, strict=True)
    if bad == TAG_DICT:
        return (f"keyword arguments '__type__' and '__value__' together make a {TAG_DICT}, "
                "which the journal would read back as another type")
    if bad == RESERVED_DICT:
        return (f"keyword argument {RESERVED_KEY!r} is the key the journal reserves for an "
                "encrypted value, which would make the arguments unreadable")
    if bad is not None:
        return f"a keyword argument's name holds {bad.removeprefix('dict key with ')}"
    return None


def check_arguments(signature: inspect.Signature | None, args: Any, kwargs: Any,
                    what: str) -> None:
    """Raise BadInput naming the first argument of ``what`` (``arguments of tool 'x'``)
    that cannot be journaled, with the fix: rename a key, or pass what JSON carries."""
    bad = bad_argument(signature, args, kwargs)
    if bad is None:
        return
    if bad.startswith(("keyword argument", "a keyword argument")) or bad.endswith(
            _KEY_PROBLEMS):
        raise BadInput(f"{what} cannot be journaled: {bad}; {_RENAME}")
    raise BadInput(
        f"{what} are not JSON: {bad}; pass what Celery's JSON carries (str, int, float, "
        "bool, None, list, dict, datetime, date, time, Decimal, UUID, or a type "
        "registered with kombu.utils.json.register_type), e.g. an id instead of an object")


def check_size(encoded: str, what: str, limit: int) -> None:
    """Refuse a value whose JSON (``encoded``) is over ``limit`` bytes: the journal and
    every message would carry it (SAGAWORKER_MAX_ARGS_BYTES)."""
    size = len(encoded.encode())
    if size > limit:
        raise BadInput(
            f"{what} are {size} bytes, over the {limit}-byte limit "
            "(SAGAWORKER_MAX_ARGS_BYTES); pass a reference (an id, a URL) instead of the "
            "data; nothing was journaled")


def unheld_result(value: Any, limit: int) -> str | None:
    """Why a tool's or a durable unit's result is not journaled (its effect happened: the
    step is EXECUTED with this as its error), or None: it is not JSON, or its JSON is over
    ``limit`` bytes (SAGAWORKER_MAX_RESULT_BYTES)."""
    bad = not_json(value)
    if bad is not None:
        return f"result is not JSON: {bad}"
    too_large = oversize(_dumps(value), limit)
    return None if too_large is None else f"result is {too_large}"


def oversize(encoded: str, limit: int) -> str | None:
    """``N bytes, over the limit ...; return a reference`` when a result's JSON
    (``encoded``) is over ``limit`` bytes (SAGAWORKER_MAX_RESULT_BYTES), else None: the
    journal would hold it, and every reader (the API, the dashboard) be served it."""
    size = len(encoded.encode())
    if size <= limit:
        return None
    return (f"{size} bytes, over the {limit}-byte limit (SAGAWORKER_MAX_RESULT_BYTES); "
            "return a reference (an id, a URL) instead of the data")


def storable(text: str) -> str:
    """Free text (a reason) as the journal can hold it: a NUL written as ``\\x00``, a
    lone surrogate as its ``\\udXXX`` escape."""
    text = text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode() if unstorable(text) else text


def check_text(value: str | None, what: str) -> None:
    """A reason, an approver or an actor the journal can hold: no NUL character and no
    lone surrogate (which the database refuses with a raw error)."""
    bad = None if not isinstance(value, str) else unstorable(value)
    if bad is not None:
        raise BadInput(f"{what} holds {bad}; remove it (nothing was changed)")
