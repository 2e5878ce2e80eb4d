"""The plan relay file: the current plan's ``plan/layout`` value as a node agent read it from
etcd, for the node's workers, so that etcd sends the layout once per node, not once per worker.

Promises:

* its path is ``relay_file(progress_dir)``: ``plan_layout.json`` beside the node's progress
  files, so a worker finds it from its ``HSPMD_PROGRESS_FILE`` (``relay_file_of``) and no other
  variable is needed;
* it holds the exact bytes of one ``plan/layout`` value (``schema.PlanLayoutRecord``);
  ``write_relay`` replaces it atomically (a reader sees the old bytes or the new ones, never a
  mix) and ``read_relay`` returns at most ``MAX_RELAY_BYTES`` or None;
* nothing in it is trusted: a worker uses it only when its sha256 is the ``layout_digest`` of
  the ``plan/stamp`` it read from etcd (``hspmd_elastic.elastic.plan_watch``).

Torch-free and etcd-free (``hspmd_elastic.contract``).
"""

from __future__ import annotations

import os
from typing import Optional

from hspmd_elastic.files import atomic_write

RELAY_FILE_NAME = "plan_layout.json"
MAX_RELAY_BYTES = 1 << 20  # a plan/layout value's limit (records.MAX_VALUE_BYTES_BY_KIND)


def relay_file(progress_dir: str) -> str:
    """Where the agent whose workers report into ``progress_dir`` relays the plan."""
    return os.path.join(progress_dir, RELAY_FILE_NAME)


def relay_file_of(progress_file: Optional[str]) -> Optional[str]:
    """The relay file of a worker whose progress file is ``progress_file`` (None: none)."""
    return relay_file(os.path.dirname(progress_file)) if progress_file else None


def write_relay(path: str, payload: bytes) -> None:
    """Replace ``path`` by ``payload`` atomically (``hspmd_elastic.files``: a temporary file in
    its folder, fsynced, renamed); ``OSError`` when the folder cannot be written."""
    atomic_write(path, payload)


def relay_signature(path: str) -> Optional[tuple[int, int, int]]:
    """(inode, size, mtime in ns) of ``path``, None when it does not exist: a cheap way to see
    that the file was replaced."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def read_relay(path: str) -> Optional[bytes]:
    """The bytes of ``path`` (None when missing, unreadable or over ``MAX_RELAY_BYTES``)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RELAY_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= MAX_RELAY_BYTES else None
