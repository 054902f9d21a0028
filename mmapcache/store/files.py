"""Opening the files inside a cache: never through a symbolic link, and only the cache's own regular files; and
reading and writing its ``meta.json`` (whose content ``format.spec`` defines).

Whoever can write a cache's directory can replace a file in it with a symbolic link (or a hard link) to a file
elsewhere; a writer following it would overwrite that file. Every file of a cache is therefore opened here:
``O_NOFOLLOW`` refuses a final symlink, and ``fstat`` on the open descriptor (no race with a rename) checks that it
is a regular file with one link on the cache directory's own device. A violation is a ``CacheFormatError`` naming
the file, so a damaged or tampered cache is refused, never written through.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

from ..errors import CacheFormatError
from ..format.meta import parse_meta
from ..format.spec import META

__all__ = ["open_file", "check_entry", "is_cache", "read_meta", "write_meta"]


def _fix(directory: str) -> str:
    return f"remove the cache (`mmapcache rm --force {directory}`) and build it again"


def open_file(directory: str, name: str, flags: int) -> int:
    """Opens ``directory/name`` (``name`` has no ``/``) with ``flags``; returns the descriptor.

    Raises:
        FileNotFoundError: it does not exist (callers say what that means for them).
        CacheFormatError: it is a symbolic link, a directory or another non-regular file, has other hard links,
            or lies on another file system than the directory.
    """
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CacheFormatError(f"{path} is a symbolic link; a cache holds only its own regular files, and "
                                   f"mmapcache never writes through a link; {_fix(directory)}") from None
        if exc.errno == errno.EISDIR:
            raise CacheFormatError(f"{path} is a directory, expected a regular file; {_fix(directory)}") from None
        raise
    try:
        problem = check_entry(os.fstat(fd), os.stat(directory).st_dev)
    except BaseException:
        os.close(fd)
        raise
    if problem:
        os.close(fd)
        raise CacheFormatError(f"{path} {problem}; {_fix(directory)}")
    return fd


def check_entry(st: os.stat_result, device: int) -> str | None:
    """What is wrong with a cache file's ``stat`` (None if nothing): used on open and by ``verify``."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (a cache holds only its own regular files)"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, expected a regular file"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links (a cache file has one: another name may point outside the cache)"
    if st.st_dev != device:
        return "lies on another file system than its cache directory"
    return None


# --- meta.json ---------------------------------------------------------------------------------------------------


def is_cache(path: str) -> bool:
    """Whether ``path`` is a directory holding a ``meta.json`` (a complete cache: it is written last)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META))


def write_meta(directory: str, meta: dict[str, Any]) -> None:
    # 0o664 minus the umask, never writable by others (see _create.FILE_MODE).
    fd = os.open(os.path.join(directory, META), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o664)
    with open(fd, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


def read_meta(directory: str) -> dict[str, Any]:
    """Reads ``meta.json`` (safely: ``open_file``) and validates it (``format.meta.parse_meta``).

    Raises:
        CacheFormatError: not a cache, unknown magic or version, or a malformed file; the message names the
            file, what was found and what was expected, and the fix.
    """
    path = os.path.join(directory, META)
    fix = f"remove the damaged cache with `mmapcache rm --force {directory}` and build it again"
    try:
        with open(open_file(directory, META, os.O_RDONLY), encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise CacheFormatError(
            f"{directory} is not an mmapcache cache (it has no {META}); pass the path of a cache (`mmapcache ls` "
            "lists them) or a path that does not exist yet"
        ) from None
    except (PermissionError, UnicodeDecodeError) as exc:
        raise CacheFormatError(f"{path} cannot be read ({exc}); {fix}") from None
    return parse_meta(text, directory)
