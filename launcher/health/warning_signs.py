"""Warning signs: what the driver shows before most fatal GPU faults, as a ``suspect`` verdict.

A suspect GPU still computes correctly, but is likely to fail soon. Elastic mode drains it: the
leader replans it away while it is alive, it serves as a BSR source in that switch (its state
leaves by network, not by checkpoint), then its worker leaves. Pure bookkeeping per device, no
driver calls: ``nvml.NvmlHealthSource`` feeds it, and so can a test. The signs:

* **correctable ECC errors rising**: ``correctable_ecc`` or more new single-bit errors in the
  volatile counter since the agent first read it (errors from before belong to earlier jobs);
  a memory that corrects this many errors is wearing out, and uncorrectable ones follow;
* **a pending memory repair**: a page retirement (``nvmlDeviceGetRetiredPagesPendingStatus``,
  before A100) or a row remap (``nvmlDeviceGetRemappedRows``, A100 and newer) waits for a GPU
  reset. The memory in use is still intact (an uncorrectable error that caused the repair fails
  the device on its own, through its Xid or the uncorrectable ECC count);
* **a burst of non-fatal Xids**: ``xid_burst`` or more informational Xids within
  ``xid_window_s`` seconds (one such Xid is noise; a burst precedes hangs and falls off the bus).

Xids that are warning signs by themselves (``rules.DRAIN_XIDS``: 63 row remap pending, 92 high
single-bit ECC error rate) need no counting: the NVML source makes the device suspect at the
first one, with the Xid in the verdict.

Promises: every method is O(1) amortised and thread-safe (Xids arrive on the event thread);
``reason`` is one line naming the sign and its numbers.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class WarningThresholds:
    """When a sign makes a device suspect (see the module docstring)."""

    correctable_ecc: int = 100
    xid_burst: int = 3
    xid_window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.correctable_ecc < 1 or self.xid_burst < 1 or self.xid_window_s <= 0:
            raise ValueError(f"warning thresholds must be positive, got {self!r}")


class WarningSigns:
    """The warning signs seen per device index (see the module docstring)."""

    def __init__(self, thresholds: WarningThresholds = WarningThresholds()):
        self.thresholds = thresholds
        self._lock = threading.Lock()
        self._ecc_base: dict[int, int] = {}
        self._xids: dict[int, collections.deque] = {}

    def correctable_ecc(self, index: int, count: int) -> Optional[str]:
        """The reason when the volatile correctable ECC ``count`` rose enough since first read
        (a count below the first one means the counters were reset: it becomes the base)."""
        with self._lock:
            base = self._ecc_base.get(index)
            if base is None or count < base:
                self._ecc_base[index] = count
                return None
        rise = count - base
        if rise >= self.thresholds.correctable_ecc:
            return (f"{rise} new correctable ECC error(s) (volatile count {base} -> {count}): "
                    "the memory is wearing out")
        return None

    @staticmethod
    def pending_repair(retired_pages_pending: bool, row_remap_pending: bool) -> Optional[str]:
        if row_remap_pending:
            return "row remapping pending: a memory repair waits for a GPU reset"
        if retired_pages_pending:
            return "retired pages pending: a memory repair waits for a GPU reset"
        return None

    def xid(self, index: int, xid: int, now: float) -> None:
        """Note a non-fatal Xid of device ``index`` at ``now`` (monotonic seconds)."""
        with self._lock:
            seen = self._xids.setdefault(index, collections.deque())
            seen.append((now, xid))
            self._prune(seen, now)

    def xid_burst(self, index: int, now: float) -> Optional[str]:
        with self._lock:
            seen = self._xids.get(index)
            if not seen:
                return None
            self._prune(seen, now)
            if len(seen) < self.thresholds.xid_burst:
                return None
            xids = sorted({x for _, x in seen})
        return (f"{len(seen)} non-fatal Xids within {self.thresholds.xid_window_s:g}s "
                f"(Xid {', '.join(map(str, xids))})")

    def _prune(self, seen: collections.deque, now: float) -> None:
        while seen and (now - seen[0][0] > self.thresholds.xid_window_s
                        or len(seen) > self.thresholds.xid_burst):
            seen.popleft()
