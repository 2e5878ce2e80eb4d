"""Showing values read from etcd on a terminal: as text, never as markup or control sequences.

Anyone who can write the job's prefix chooses these strings (a host, a reason, an event's
detail). Promises: ``clean(value)`` is ``str(value)`` under the one escaping rule of
``hspmd_elastic.contract.text`` (``bounded``): every control or format character (C0, DEL, C1,
bidirectional overrides, zero-width marks) written as a visible escape (``\\x1b``, ``\\u202e``)
and cut to ``limit`` characters (saying how long it was); ``text(value, style)`` is a rich
``Text`` of it, which rich never parses as markup, so ``[/bold]`` shows as typed.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text

from hspmd_elastic.contract.text import LIMIT, bounded

clean = bounded  # ``value`` as one printable line of at most about ``limit`` characters


def text(value: Any, style: str = "", limit: int = LIMIT) -> Text:
    """A rich ``Text`` showing ``clean(value)`` (no markup is interpreted)."""
    return Text(clean(value, limit), style=style)
