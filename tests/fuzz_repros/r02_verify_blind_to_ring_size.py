"""A stream's ring.u64 extended (or truncated): opening it raises CacheFormatError, but verify() reports the cache
ok and `mmapcache verify` exits 0."""

from __future__ import annotations

import os
import subprocess
import sys

from _common import Tokens, scratch, verdict

import mmapcache
from mmapcache import CacheFormatError, MmapCachedDataset


def main() -> int:
    with scratch() as path:
        MmapCachedDataset(path, Tokens(), stream=True, max_bytes=1000, seed=3).close()
        with open(os.path.join(path, "ring.u64"), "ab") as f:
            f.write(b"\x26" * 4096)
        try:
            MmapCachedDataset(path, Tokens(), stream=True, max_bytes=1000, seed=3).close()
            opened = "opened"
        except CacheFormatError as exc:
            opened = f"CacheFormatError: {str(exc)[:100]}"
        result = mmapcache.verify(path)
        code = subprocess.run([sys.executable, "-m", "mmapcache", "verify", path], capture_output=True,
                              check=False).returncode
        print(f"open: {opened}; verify ok: {result.ok}; CLI exit {code}")
        return verdict(result.ok or code != 1, "verify must report what opening the cache refuses")


if __name__ == "__main__":
    sys.exit(main())
