"""Text that came from etcd or another process, shown in a log or on a terminal: one rule.

Anyone who can write the job's etcd prefix (or a worker's files) chooses these strings: a host,
a reason, an event's detail, a bad key. Promises:

* ``escape(text)``: every character of Unicode category Cc (C0 controls, DEL, C1 controls),
  Cf (format characters: bidirectional overrides, zero-width marks, the soft hyphen), Cs (lone
  surrogates, which no terminal encoding can print), Zl and Zp (line and paragraph separators)
  is written as a visible escape: ``\\xNN`` below U+0100, ``\\uNNNN`` below U+10000, else
  ``\\UNNNNNNNN``; a tab becomes one space. Every other character is kept, so the result is one
  line with no escape sequence a terminal would act on;
* ``bounded(value, limit)``: ``str(value)`` cut to ``limit`` characters, then escaped; a cut
  text ends in ``... (N chars)``, ``N`` the length before the cut;
* ``first_line(value, limit)``: the first line of ``str(value)`` with surrounding blanks
  stripped ("" for blank text), then bounded the same way.

Torch-free and etcd-free (``hspmd_elastic.contract``).
"""

from __future__ import annotations

import unicodedata
from typing import Any

LIMIT = 200  # default characters of one value shown
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _escape_char(ch: str) -> str:
    if ch == "\t":
        return " "
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape(text: str) -> str:
    """``text`` with every control, format, surrogate and line/paragraph separator character
    written as a visible escape (a tab as a space); see the module docstring."""
    if text.isprintable():  # fast path: no Cc, Cf, Cs, Zl, Zp (nor other separators) inside
        return text
    return "".join(_escape_char(ch) if unicodedata.category(ch) in ESCAPED_CATEGORIES else ch
                   for ch in text)


def bounded(value: Any, limit: int = LIMIT) -> str:
    """``value`` as one printable line: at most ``limit`` characters of ``str(value)``, escaped,
    then ``... (N chars)`` when it was cut."""
    s = value if isinstance(value, str) else str(value)
    length = len(s)
    s = escape(s[:limit])
    return f"{s}... ({length} chars)" if length > limit else s


def first_line(value: Any, limit: int = LIMIT) -> str:
    """The first line of ``value`` (surrounding blanks stripped), bounded as ``bounded`` does."""
    s = (value if isinstance(value, str) else str(value)).strip()
    return bounded(s.splitlines()[0] if s else "", limit)
