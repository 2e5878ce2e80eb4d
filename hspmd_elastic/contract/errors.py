"""The two errors a contract check raises, shared by both planes.

Promises:

* ``CoordinationError`` is the root of every error about the job's shared state: the etcd
  transport's errors (``hspmd_elastic.coord.api``) derive from it, and so does ``RecordError``,
  so one ``except CoordinationError`` covers a lost etcd and a bad record alike;
* a ``RecordError`` shows the bad key and problem with ``contract.text.bounded`` (cut, control
  and format characters escaped): what anyone can write to etcd never reaches a log whole.
"""

from __future__ import annotations

from hspmd_elastic.contract.text import bounded


class CoordinationError(Exception):
    """Root of every error about the job's shared state (transport or record)."""


class RecordError(CoordinationError):
    """A value under a schema key is not a valid record (names the key and what is wrong)."""

    def __init__(self, key: str, problem: str):
        self.key = key
        # values come from etcd: never echo them whole, nor a terminal escape sequence
        self.problem = bounded(problem, 300)
        super().__init__(f"bad record at {bounded(repr(key), 200)}: {self.problem}")
