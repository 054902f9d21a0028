"""Child processes that die with the process that started them, and own their signal handling.

A producer (``fill.producer``) or a build worker runs until told to stop. If the process that started it dies without
telling it (SIGKILL, the OOM killer, a scheduler killing the job), nothing else would: it would go on computing
samples for nobody, holding the cache's ``users`` lock so that ``mmapcache rm`` refuses to remove the cache. So each
such child watches its parent from a thread and exits as soon as the parent is gone (the kernel hands an orphan to
another parent: ``getppid()`` changes).

A thread rather than ``prctl(PR_SET_PDEATHSIG)``: the kernel sends that signal when the *thread* that forked the
child exits, which would kill producers started from a short-lived thread of a healthy parent. Exiting with
``os._exit`` mid-sample is safe: it is what SIGKILL does, which every writer of the format survives (a row left
mid-write reads as unfilled; claims and locks die with the process).
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["die_with_parent", "own_signals"]

_POLL = 0.1  # seconds between looks at the parent
EXIT_ORPHANED = 3  # the exit status of a child whose parent died


def die_with_parent(parent: int) -> None:
    """Makes this process exit (status ``EXIT_ORPHANED``) within ``_POLL`` seconds of the death of ``parent``, the
    pid of the process that started it (passed from there: a parent that died before this call is seen too).
    Returns at once; the watch runs in a daemon thread. Safe to call more than once."""
    if os.getppid() != parent:
        os._exit(EXIT_ORPHANED)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="mmapcache-parent-watch", daemon=True).start()


def own_signals() -> None:
    """Gives this (forked) child the default handling of SIGTERM and SIGINT instead of its parent's.

    At the parent's exit, ``multiprocessing`` terminates its daemon children with SIGTERM and joins them. A child
    forked from a parent that installed its own SIGTERM handler (PyTorch Lightning does, during ``fit``) inherited
    it, logged the signal and went on, and the parent waited for it forever. SIGTERM now ends the child (a kill:
    safe at any moment, see the module docstring), and SIGINT (a Ctrl-C to the job's process group) raises
    ``KeyboardInterrupt``, on which a producer stops."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
