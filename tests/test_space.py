"""A full file system: a real 1 MiB tmpfs gives ``InsufficientSpaceError`` naming bytes needed versus free and the
fixes, leaves nothing behind, and never crashes a process (space is reserved before any byte is mapped)."""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from helpers.sources import ImageLabels, sample_equal
from mmapcache import InsufficientSpaceError, MmapCachedDataset, MmapCacheError

MIB = 1024 * 1024


@pytest.fixture
def tiny_tmpfs(tmp_path: Any) -> Iterator[str]:
    """A 1 MiB tmpfs mounted in a temporary directory, unmounted afterwards (needs root: skipped otherwise)."""
    mount_point = str(tmp_path / f"tiny-{uuid.uuid4().hex[:8]}")
    os.makedirs(mount_point)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", mount_point],
                            capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs (needs root or CAP_SYS_ADMIN): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        # Lazy unmount: a map a failed test left open must not leave the mount behind.
        subprocess.run(["umount", "-l", mount_point], capture_output=True, timeout=30)


def _free(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _leftovers(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def test_too_large_cache_raises_with_bytes_and_fixes(tiny_tmpfs: str) -> None:
    source = ImageLabels(200, shape=(3, 64, 64))  # 2.4 MB of images
    path = os.path.join(tiny_tmpfs, "cache")
    free = _free(tiny_tmpfs)
    with pytest.raises(InsufficientSpaceError) as info:
        MmapCachedDataset(path, source)
    message = str(info.value)
    needed = int(re.search(r"needs (\d+) bytes", message).group(1))
    reported_free = int(re.search(r"has (\d+) bytes", message).group(1))
    assert needed >= 200 * 3 * 64 * 64 > reported_free and reported_free == free
    for fix in ("max_bytes=", "MMAPCACHE_DIR", "mmapcache rm", "--shm-size"):
        assert fix in message
    assert isinstance(info.value, OSError) and isinstance(info.value, MmapCacheError)
    assert _leftovers(tiny_tmpfs) == [] and _free(tiny_tmpfs) == free


def test_the_suggested_max_bytes_works(tiny_tmpfs: str) -> None:
    source = ImageLabels(200, shape=(3, 64, 64))
    path = os.path.join(tiny_tmpfs, "cache")
    with pytest.raises(InsufficientSpaceError) as info:
        MmapCachedDataset(path, source)
    max_bytes = int(re.search(r"max_bytes=(\d+)", str(info.value)).group(1))
    with MmapCachedDataset(path, source, max_bytes=max_bytes) as ds:
        assert 0 < ds.num_cacheable < 200
        ds.fill()
        assert ds.num_cached == ds.num_cacheable
        for i in range(0, 200, 7):  # cached ones are hits, the rest pass through to the source
            assert sample_equal(ds[i], source[i])
    assert _leftovers(tiny_tmpfs) == ["cache"]


def test_a_full_cache_filled_to_the_last_byte_and_a_second_one_refused(tiny_tmpfs: str) -> None:
    first = os.path.join(tiny_tmpfs, "first")
    source = ImageLabels(60, shape=(3, 64, 64))  # 737 KB: fits once, not twice
    with MmapCachedDataset(first, source) as ds:
        ds.fill()  # every page was reserved at creation: no SIGBUS while writing
        with pytest.raises(InsufficientSpaceError):
            MmapCachedDataset(os.path.join(tiny_tmpfs, "second"), source)
        assert all(sample_equal(ds[i], source[i]) for i in range(60))
    assert _leftovers(tiny_tmpfs) == ["first"]


def test_many_small_files_that_overflow_the_file_system(tiny_tmpfs: str) -> None:
    """Each field is a file, and tmpfs gives every file whole pages: 250 tiny fields (just under the 256-field
    limit) need 1 MB even though their data is 2 KB. Creation must fail cleanly (the fallocate or the header write
    hits ENOSPC)."""
    source = [{f"f{k}": k for k in range(250)}] * 2
    path = os.path.join(tiny_tmpfs, "cache")
    with pytest.raises(InsufficientSpaceError) as info:
        MmapCachedDataset(path, source)
    message = str(info.value)
    assert "not enough space for the cache at " + path in message
    needed = int(re.search(r"needs (\d+) bytes", message).group(1))
    free = int(re.search(r"has (\d+) bytes", message).group(1))
    assert needed > free, f"the message must explain the failure: {message}"
    assert _leftovers(tiny_tmpfs) == []
