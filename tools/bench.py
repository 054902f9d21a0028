"""The mmapcache benchmark's command: ``python3 tools/bench.py [--quick] [--repeat K] [--only GROUP,...] ...``.

The benchmark itself is the package ``benchmark`` beside this file (``tools/README.md`` lists its modules); this
entry only runs ``benchmark.run.main``, so that the command the documentation cites stays the same.
"""

from __future__ import annotations

import sys

from benchmark.run import main

if __name__ == "__main__":
    sys.exit(main())
