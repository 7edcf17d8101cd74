"""A database URL as a message may show it: every form of its password masked.

A password hides in more places than SQLAlchemy's ``render_as_string(hide_password=True)``
masks: in the query (``?password=``, libpq's ``sslpassword=``, MySQL's ``passwd=``), and
after an unescaped ``@`` (``user:p@ss@host``), which SQLAlchemy reads as the password
``p`` and the host ``ss@host``, so the driver's own "cannot resolve host" error quotes the
rest. :func:`masked` shows the URL with each of them as ``***``; :func:`scrubbed` takes
them (and each ``@``-separated piece of the password) out of free text such as a driver's
error. The raw text is read, not SQLAlchemy's parse, so a URL it misreads is masked too.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

__all__ = ["masked", "scrubbed"]

MASK = "***"
#: query parameters that hold a secret (``password``, ``sslpassword``, ``passwd``, ...)
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token", re.I)
#: a shorter piece of a password is not scrubbed from free text (it would shred words)
_MIN_PIECE = 3


def _text(url: Any) -> str:
    if isinstance(url, str):
        return url
    render = getattr(url, "render_as_string", None)  # an sqlalchemy URL
    return render(hide_password=False) if callable(render) else str(url)


def _parts(url: str) -> tuple[str, str, str | None, str, str | None] | None:
    """(scheme, user, password, host and path, query): the userinfo ends at the last
    ``@`` before the query, so a password holding an unescaped ``@`` stays whole."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    qpos = rest.find("?")
    body, query = (rest, None) if qpos < 0 else (rest[:qpos], rest[qpos + 1:])
    at = body.rfind("@")
    if at < 0:
        return scheme, "", None, body, query
    user, colon, password = body[:at].partition(":")
    return scheme, user, password if colon else None, body[at + 1:], query


def _query(query: str) -> tuple[str, list[str]]:
    """The query with each secret parameter's value masked, and those values."""
    shown, secrets = [], []
    for item in query.split("&"):
        key, eq, value = item.partition("=")
        if eq and _SECRET_PARAM.search(unquote(key)):
            shown.append(f"{key}={MASK}")
            secrets.append(value)
        else:
            shown.append(item)
    return "&".join(shown), secrets


def masked(url: Any) -> str:
    """``url`` (a string or an SQLAlchemy URL) as it may be shown: every password form
    replaced by ``***``; a string that is not a URL shows nothing of itself."""
    text = _text(url)
    parts = _parts(text)
    if parts is None:
        return "(not a URL)"
    scheme, user, password, rest, query = parts
    out = f"{scheme}://"
    if password is not None:
        out += f"{user}:{MASK}@"
    elif user:
        out += f"{user}@"
    out += rest
    if query is not None:
        out += "?" + _query(query)[0]
    return out


def _secrets(url: Any) -> list[str]:
    parts = _parts(_text(url))
    if parts is None:
        return [_text(url)]
    _scheme, _user, password, _rest, query = parts
    found = [] if query is None else _query(query)[1]
    if password is not None:
        found += [password, *password.split("@")]
    out = {v for s in found for v in (s, unquote(s)) if len(v) >= _MIN_PIECE}
    return sorted(out, key=len, reverse=True)


def scrubbed(text: str, url: Any) -> str:
    """``text`` (a driver's error, say) with every secret of ``url`` in it as ``***``."""
    for secret in _secrets(url):
        text = text.replace(secret, MASK)
    return text
