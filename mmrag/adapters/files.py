"""Atomic file writes: the one way mmrag replaces a file that others read (feature-store entries, the tenants
file, uploaded documents).

The bytes go to a temp file in the target's folder, are flushed and fsynced, the temp file is renamed over the
target, and the folder is fsynced. A reader then sees the old file or the whole new one, never a torn one; a
writer killed half-way (or a disk full) leaves at most its temp file, which is removed when the write fails;
and after a power loss a write that returned is on disk, rename included (without the folder's fsync the
rename itself can be lost: an entry, or a tenant's new key, acknowledged and then gone).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


class AtomicFile:
    """A temp file being written; ``commit`` publishes it under its final name."""

    def __init__(self, file: BinaryIO, tmp: Path) -> None:
        self.file = file
        self.tmp = tmp
        self._closed = False

    def write(self, data: bytes) -> int:
        return self.file.write(data)

    def commit(self, path: Path, *, mode: int | None = None) -> None:
        """Flush, fsync, (chmod), rename over ``path`` (on the temp file's filesystem), fsync ``path``'s folder."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if mode is not None:
            os.chmod(self.tmp, mode)
        os.replace(self.tmp, path)
        self._closed = True
        _fsync_dir(Path(path).parent)

    def discard(self) -> None:
        """Remove the temp file, unless it was committed."""
        if not self._closed:
            self._closed = True
            self.file.close()
            self.tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(folder: Path, *, prefix: str = ".tmp-", suffix: str = "") -> Iterator[AtomicFile]:
    """A binary temp file in ``folder`` (created if missing), for a target whose name may be known only once
    the bytes are (an upload is named by its hash). Left without ``commit``, or on an exception, it is removed."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=suffix)
    out = AtomicFile(os.fdopen(fd, "wb"), Path(tmp))
    try:
        yield out
    finally:
        out.discard()


def write_atomically(path: Path, data: bytes | str, *, prefix: str = ".tmp-", suffix: str = "",
                     mode: int | None = None) -> None:
    """``path`` holds ``data`` (a str as UTF-8), replaced atomically and durably; ``mode``: its permissions.
    ``prefix``/``suffix`` name the temp file, so that a cleaner can tell a dead writer's leftovers."""
    path = Path(path)
    with atomic_file(path.parent, prefix=prefix, suffix=suffix) as out:
        out.write(data.encode("utf-8") if isinstance(data, str) else data)
        out.commit(path, mode=mode)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
