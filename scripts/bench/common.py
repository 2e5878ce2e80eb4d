"""What several benchmarks share: the repository's paths, progress lines, medians and ratios,
table cells and Markdown tables, argument types that refuse bad values in one line, the JSON
dump and the docs section writer. Stdlib only at import time.

Promises:

* ``ratio(a, b)`` is ``a / b``, or None when either is missing or ``b`` is 0;
  ``best(values)`` the largest present value (None when none);
  ``median_of(rows, key)`` the median of the present values of ``key`` (NaN when none);
* ``fmt(v, spec)`` and ``ms(seconds)`` are ``-`` for a missing value; ``cell(text)`` makes a
  layout line (``a | b``) fit one table cell;
* ``md_table(header, rows)`` is the lines of a Markdown table;
* ``int_flag``/``seconds_flag`` are ``argparse`` types whose errors name the flag and the value;
* ``with_section(text, section, body)`` replaces ``section`` (up to the next ``## ``) or appends
  it; ``write_section(path, section, body)`` re-reads the file right before writing it
  atomically (other sections belong to other benchmarks; a failure never truncates the doc);
* ``dump(path, result)`` writes JSON atomically, NaN and infinities as null.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Mapping, Optional, Sequence

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(SCRIPTS)


def say(tag: str, msg: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- numbers ---------------------------------------------------------------------------------

def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def best(values) -> Optional[float]:
    present = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return max(present) if present else None


def median_of(rows: Sequence[Mapping], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


# ---- cells and tables --------------------------------------------------------------------------

def fmt(v: Optional[float], spec: str = "{:,.0f}") -> str:
    return "-" if v is None else spec.format(v)


def ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def cell(layout: Optional[str]) -> str:
    """A layout line in a table cell (its ``|`` separators would split the cell)."""
    return "-" if not layout else layout.replace(" | ", "; ")


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


# ---- arguments ---------------------------------------------------------------------------------

def int_flag(flag: str, low: int, high: int = 10 ** 9):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}={text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag}={value} must be in [{low}, {high}]")
        return value
    return parse


def seconds_flag(flag: str, low: float, high: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}={text!r} is not a number") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{flag}={text} must be in [{low:g}, {high:g}] s")
        return value
    return parse


# ---- files -------------------------------------------------------------------------------------

def with_section(text: str, section: str, body: str) -> str:
    """``text`` with ``section`` replaced by ``body`` (or appended when it has none)."""
    if text.startswith(section + "\n"):
        start = 0
    else:
        start = text.find("\n" + section + "\n")
        if start < 0:
            return text.rstrip("\n") + "\n\n" + section + "\n\n" + body.strip("\n") + "\n"
        start += 1
    nxt = text.find("\n## ", start + len(section))
    tail = "" if nxt < 0 else text[nxt:]
    return text[:start] + section + "\n\n" + body.strip("\n") + "\n" + tail


def write_section(path: str, section: str, body: str) -> None:
    from hspmd_elastic.files import atomic_write  # temporary file, fsync, rename

    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:  # re-read right before writing
            text = f.read()
    atomic_write(path, with_section(text or "# Benchmarks\n", section, body))


def finite(value):
    """JSON without Infinity/NaN: those become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dump(path: str, result: Mapping) -> None:
    from hspmd_elastic.files import atomic_write

    atomic_write(path, json.dumps(finite(result), indent=2, sort_keys=True, default=str))
