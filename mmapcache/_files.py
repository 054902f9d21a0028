"""Opening the files inside a cache: never through a symbolic link, and only the cache's own regular files.

Whoever can write a cache's directory can replace a file in it with a symbolic link (or a hard link) to a file
elsewhere; a writer following it would overwrite that file. Every file of a cache is therefore opened here:
``O_NOFOLLOW`` refuses a final symlink, and ``fstat`` on the open descriptor (no race with a rename) checks that it
is a regular file with one link on the cache directory's own device. A violation is a ``CacheFormatError`` naming
the file, so a damaged or tampered cache is refused, never written through.
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import CacheFormatError

__all__ = ["open_file", "check_entry"]


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
