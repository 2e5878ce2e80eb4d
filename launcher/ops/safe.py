"""Showing values read from etcd on a terminal: as text, never as markup or control sequences.

Anyone who can write the job's prefix chooses these strings (a host, a reason, an event's
detail). Promises: ``clean(value)`` is ``str(value)`` with every control or format character
(C0, DEL, C1, bidirectional overrides, zero-width marks) written as a visible escape (``\\x1b``,
``\\u202e``) and cut to ``limit`` characters (saying how long it was); ``text(value, style)`` is
a rich ``Text`` of it, which rich never parses as markup, so ``[/bold]`` shows as typed.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from rich.text import Text

LIMIT = 200  # characters of one value shown in a terminal cell


def _escape(ch: str) -> str:
    if ch == "\t":
        return " "
    if ord(ch) < 0x100:
        return f"\\x{ord(ch):02x}"
    return f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}"


def clean(value: Any, limit: int = LIMIT) -> str:
    """``value`` as one printable line of at most about ``limit`` characters."""
    s = value if isinstance(value, str) else str(value)
    length = len(s)
    s = s[:limit]
    if not s.isprintable():
        s = "".join(_escape(ch) if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp")
                    else ch for ch in s)
    return f"{s}... ({length} chars)" if length > limit else s


def text(value: Any, style: str = "", limit: int = LIMIT) -> Text:
    """A rich ``Text`` showing ``clean(value)`` (no markup is interpreted)."""
    return Text(clean(value, limit), style=style)
