"""Canonical JSON: what the journal stores, what digests and size limits are taken over."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ._errors import BadInput

__all__ = ["args_digest", "canonical_args", "check_json"]


def canonical_args(args: Any, kwargs: Any) -> str:
    return json.dumps([list(args), dict(kwargs)], sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False)


def args_digest(args: Any, kwargs: Any) -> str:
    return hashlib.sha256(canonical_args(args, kwargs).encode()).hexdigest()


def check_json(value: Any, what: str) -> str:
    """Encode ``value`` as strict JSON or raise BadInput saying how to fix it."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadInput(
            f"{what} is not JSON ({exc}); pass and return only JSON types "
            "(str, int, float, bool, None, list, dict with str keys), e.g. an id "
            "instead of an object"
        ) from exc
