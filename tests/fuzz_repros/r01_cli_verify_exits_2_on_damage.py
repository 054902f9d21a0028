"""`mmapcache verify` exits 2 (the usage-error status) on damage that verify() raises CacheFormatError for, e.g. a
keys.i64 one byte short or heaps.u64 truncated; damage is exit 1. (Fuzzer: every file, every kind.)"""

from __future__ import annotations

import os
import subprocess
import sys

from _common import scratch, texts_cache, verdict


def main() -> int:
    codes = {}
    for name in ("keys.i64", "heaps.u64", "seq.u32"):
        with scratch() as path:
            texts_cache(path)
            os.truncate(os.path.join(path, name), max(0, os.path.getsize(os.path.join(path, name)) - 1))
            out = subprocess.run([sys.executable, "-m", "mmapcache", "verify", path], capture_output=True, text=True,
                                 check=False)
            codes[name] = out.returncode
            print(f"{name} truncated: exit {out.returncode}: {out.stderr.strip()[:160]}")
    return verdict(any(code != 1 for code in codes.values()), f"exit codes {codes}, expected 1 for each")


if __name__ == "__main__":
    sys.exit(main())
