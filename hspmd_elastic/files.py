"""Atomic file writes: a file the project writes is either its old bytes or its new ones, never
a mix, an empty file or a torn one, whatever fails half-way (an exception, a full disk, a kill).

Every write goes to a temporary file in the target's own directory (same file system, so the
rename is atomic), named ``.<name>.<random>.tmp`` (a dot file: no reader globbing ``*.bin`` or
``shard-*.pt`` sees it). On success the temporary file is flushed and fsynced, renamed over the
target with ``os.replace``, and the directory is fsynced, so the rename itself survives a power
loss. On any exception, ``KeyboardInterrupt`` included, the temporary file is removed and the
target is left as it was; the exception propagates unchanged. New files get the usual
``0o666 & ~umask`` permissions, as ``open(path, "w")`` would give them.

* ``atomic_write(path, data)``: ``data`` is ``bytes``, ``str`` (UTF-8) or a callable that
  writes to the open binary file.
* ``atomic_open(path, mode="wb")``: a context manager yielding the open temporary file (``"w"``
  for text, UTF-8 unless ``encoding`` says otherwise).
* ``atomic_path(path)``: a context manager yielding the temporary file's *path*, for writers that
  only take a file name (``safetensors.torch.save_file``).
* ``atomic_group()``: several files replaced together (a ``.bin`` and its index): each is staged
  as above, and only when the whole block succeeds are all of them fsynced and then renamed, in
  the order they were staged. A failure anywhere leaves every target untouched. The renames are
  not one atomic step: a crash between two renames leaves some new files beside old ones, which
  is why the project's paired formats record in the later file what the earlier must hold (a
  sidecar's token count, an index's byte size) and refuse a pair that disagrees.

``durable=False`` (every function takes it) skips both fsyncs: the rename still makes the
switch atomic while the machine runs (a reader sees the old file or the new one, never a torn
one, whatever happens to the writer), but after a power loss the target may hold its old bytes,
or be empty or missing. It is for files rewritten continually and read only while their writer
runs (a worker's progress heartbeat), where an fsync per write costs more than any such loss.

A crash (SIGKILL, power loss) before the rename can leave a ``.<name>.<random>.tmp`` behind;
it is never read, and ``stale_temporaries(directory)`` lists such files for a cleanup.
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from typing import IO, Callable, Iterator, Union

TMP_SUFFIX = ".tmp"
Data = Union[bytes, bytearray, memoryview, str, Callable[[IO[bytes]], object]]


def temporary_name(path: str) -> str:
    """A fresh temporary name beside ``path``: ``DIR/.<name>.<random>.tmp``."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{secrets.token_hex(6)}{TMP_SUFFIX}")


def is_temporary(name: str) -> bool:
    """Whether ``name`` (a base name) is one of this module's temporary files."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX) and name.count(".") >= 3


def stale_temporaries(directory: str) -> list[str]:
    """The temporary files a crashed writer left in ``directory`` (paths, sorted)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names if is_temporary(n))


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be fsynced)."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (and platforms) refuse fsync on a directory
    finally:
        os.close(fd)


def _create(tmp: str) -> int:
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                   0o666)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


class AtomicGroup:
    """Files staged under temporary names, replaced together on ``commit`` (module doc)."""

    def __init__(self, durable: bool = True) -> None:
        self._staged: list[tuple[str, str]] = []  # (temporary, target), in staging order
        self._open: list[IO] = []
        self.durable = durable  # False: no fsync of the files nor the folders (module doc)

    def path(self, target: str) -> str:
        """A temporary path (not created) to write ``target``'s new contents to by name."""
        tmp = temporary_name(target)
        self._staged.append((tmp, os.path.abspath(target)))
        return tmp

    def open(self, target: str, mode: str = "wb", encoding: str = "utf-8") -> IO:
        """The temporary file of ``target``, open for writing (``"wb"`` or ``"w"``)."""
        if mode not in ("w", "wb"):
            raise ValueError(f"atomic write mode {mode!r} is not 'w' or 'wb'")
        tmp = temporary_name(target)
        fd = _create(tmp)
        self._staged.append((tmp, os.path.abspath(target)))
        f = os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding}))
        self._open.append(f)
        return f

    def commit(self) -> None:
        """fsync every staged file, then rename each over its target and fsync the folders
        (renames only, when not ``durable``)."""
        for f in self._open:
            f.flush()
            if self.durable:
                os.fsync(f.fileno())
            f.close()
        self._open.clear()
        if self.durable:
            for tmp, _target in self._staged:
                _fsync_file(tmp)
        folders = []
        for tmp, target in self._staged:
            os.replace(tmp, target)
            folder = os.path.dirname(target)
            if folder not in folders:
                folders.append(folder)
        self._staged.clear()
        for folder in folders if self.durable else ():
            fsync_dir(folder)

    def abort(self) -> None:
        """Close and remove every staged temporary file; the targets stay as they were."""
        for f in self._open:
            try:
                f.close()
            except OSError:
                pass
        self._open.clear()
        for tmp, _target in self._staged:
            _discard(tmp)
        self._staged.clear()


@contextmanager
def atomic_group(durable: bool = True) -> Iterator[AtomicGroup]:
    """Stage files in the block; all are replaced when it ends normally, none otherwise."""
    group = AtomicGroup(durable)
    try:
        yield group
        group.commit()
    except BaseException:
        group.abort()
        raise


@contextmanager
def atomic_open(path: str, mode: str = "wb", encoding: str = "utf-8",
                durable: bool = True) -> Iterator[IO]:
    """The temporary file of ``path``, replacing ``path`` when the block ends normally."""
    with atomic_group(durable) as group:
        yield group.open(path, mode, encoding)


@contextmanager
def atomic_path(path: str, durable: bool = True) -> Iterator[str]:
    """A temporary path to write ``path``'s new contents to by name; renamed over ``path`` when
    the block ends normally (the block must have created it), removed otherwise."""
    with atomic_group(durable) as group:
        yield group.path(path)


def atomic_write(path: str, data: Data, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` (bytes, str as UTF-8, or a writer of the binary file)."""
    with atomic_open(path, "wb", durable=durable) as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
