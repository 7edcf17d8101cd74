"""Journal text as a person may be shown it: characters that reorder or hide text written
as escapes (``\\u202e``), so what an operator reads is what the journal holds.

A right-to-left override makes ``acct 4321`` render as another number; a zero-width space
makes two ids look equal; a terminal escape recolours or hides what follows. Every such
character (controls but tab and line break, Unicode's format characters: bidi embeddings,
overrides, isolates and marks, zero-width characters, the BOM; line and paragraph
separators) is shown as its code. Printable text, accents and scripts included, is left
as it is.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["visible"]

#: control, format (bidi, zero-width), line/paragraph separator, surrogate
_HIDDEN = {"Cc", "Cf", "Zl", "Zp", "Cs"}
#: what Python's isprintable() refuses (a superset: the check below narrows it)
_CANDIDATE = re.compile(r"[^\x20-\x7e]")


def _escape(m: re.Match[str]) -> str:
    ch = m.group()
    if ch in "\t\n" or unicodedata.category(ch) not in _HIDDEN:
        return ch
    n = ord(ch)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def visible(text: str) -> str:
    """``text`` with every hidden or reordering character written as its escape."""
    if text.isprintable():
        return text
    return _CANDIDATE.sub(_escape, text)

