"""Where caches live: ``$MMAPCACHE_DIR`` (default ``/dev/shm/mmapcache``) and turning a name or path into the
real directory of a cache."""

from __future__ import annotations

import os

__all__ = ["DEFAULT_DIR", "cache_root", "resolve_path"]

DEFAULT_DIR = "/dev/shm/mmapcache"
_NAME_MAX = 255  # bytes in one file name on Linux file systems (tmpfs, ext4, xfs)


def cache_root() -> str:
    """The directory that bare cache names resolve in: ``$MMAPCACHE_DIR``, default ``/dev/shm/mmapcache``."""
    return os.environ.get("MMAPCACHE_DIR") or DEFAULT_DIR


def resolve_path(path: str | os.PathLike[str]) -> str:
    """The real path of a cache: a path containing ``/`` is used as given, a bare name resolves under
    ``cache_root()``; symbolic links are resolved once, here, so that every later operation (creating, removing,
    sweeping beside it) acts on the real directory and its real parent, never beside a link.

    Raises:
        TypeError: not a str or path. ValueError: empty, ``.``/``..``, or a name longer than the file system
            allows (255 bytes).
    """
    try:
        text = os.fspath(path)
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise TypeError(f"cache path must be a non-empty str or os.PathLike, got {path!r}")
    if "/" not in text:
        if text in (".", ".."):
            raise ValueError(f"cache name {text!r} is not a name; pass a directory path or a plain name like "
                             "'imagenet-224'")
        text = os.path.join(cache_root(), text)
    name = os.path.basename(os.path.normpath(text))
    if len(os.fsencode(name)) > _NAME_MAX:
        raise ValueError(f"cache name {name[:40]!r}... is {len(os.fsencode(name))} bytes long; file names are limited "
                         f"to {_NAME_MAX} bytes: use a shorter name (e.g. a hash of the long one)")
    return os.path.realpath(text)
