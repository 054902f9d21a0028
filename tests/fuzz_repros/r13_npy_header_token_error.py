"""Two zero bytes in a fixed field's .npy header dict (offset 10): numpy's header parser raises
tokenize.TokenError, which Store._map_npy does not turn into CacheFormatError; opening, verify() and describe()
raise it, and `mmapcache verify` dies with a traceback (exit 1, looks like "damage found")."""

from __future__ import annotations

import os
import subprocess
import sys

from _common import Images, scratch, verdict

import mmapcache
from mmapcache import CacheFormatError, MmapCachedDataset


def main() -> int:
    with scratch() as path:
        with MmapCachedDataset(path, Images()) as ds:
            ds.fill(range(9))
        with open(os.path.join(path, "0.npy"), "r+b") as f:
            f.seek(10)
            f.write(b"\0\0")
        try:
            mmapcache.verify(path)
            error: Exception | None = None
        except Exception as exc:
            error = exc
        out = subprocess.run([sys.executable, "-m", "mmapcache", "verify", path], capture_output=True, text=True,
                             check=False)
        print(f"verify(): {type(error).__module__}.{type(error).__name__}; CLI exit {out.returncode}, traceback: "
              f"{'Traceback' in out.stderr}")
        return verdict(not isinstance(error, CacheFormatError) or "Traceback" in out.stderr,
                       "a garbled header is CacheFormatError, and the CLI reports it as damage")


if __name__ == "__main__":
    sys.exit(main())
