"""``mmapcache verify``, ``rm`` and ``gc``: checking a cache against damage and its source, and removing caches and
leftovers (only mmapcache's own)."""

from __future__ import annotations

import argparse
import sys
import textwrap

from ..errors import UsageError
from .args import Add, existing_dir, parse_kwargs, positive_int

__all__ = ["register"]


def register(add: Add) -> None:
    """Adds this module's subcommands (``add`` makes a subparser: name, help, example, description)."""
    p = add("rm", "remove caches (only caches; refuses caches in use unless --force)",
            "mmapcache rm imagenet-224 old-run")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--force", action="store_true",
                   help="remove even if processes use it (they keep their mapped pages) or it is damaged")
    p.set_defaults(run=_cmd_rm)

    p = add("verify", "check a cache's files, and compare samples with the source",
            "mmapcache verify imagenet-224 --source mypkg.data:ImageNet --kwargs '{\"root\": \"/data\"}' --samples 500",
            description=textwrap.dedent("""\
                Check the cache's format and state files. With --source, also recompute a random sample of the
                filled samples and compare them byte for byte. Only meaningful for deterministic sources: a
                source with random augmentation differs on every call.

                Exit status: 0 clean, 1 damage, differences or a mismatch (another source) found, 2 usage error."""))
    p.add_argument("path", metavar="PATH")
    p.add_argument("--source", metavar="SPEC", help="the dataset the cache was built from")
    p.add_argument("--kwargs", metavar="JSON", help="keyword arguments for SPEC, a JSON object")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--samples", type=positive_int, default=100, metavar="K",
                       help="recompute K random filled samples (default 100)")
    group.add_argument("--all", action="store_true", help="recompute every filled sample")
    p.set_defaults(run=_cmd_verify)

    p = add("gc", "remove leftovers of dead processes (temporary directories, orphaned delete_on_close caches)",
            "mmapcache gc /dev/shm/mmapcache")
    p.add_argument("dir", nargs="?", metavar="DIR", help="default: $MMAPCACHE_DIR or /dev/shm/mmapcache")
    p.set_defaults(run=_cmd_gc)


def _cmd_rm(args: argparse.Namespace) -> int:
    from .. import remove

    for path in remove(*args.paths, force=args.force):
        print(f"removed {path}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from .. import verify

    if args.kwargs and not args.source:
        raise UsageError("--kwargs needs --source (the dataset to compare with)")
    dataset = args.source
    result = verify(args.path, dataset, kwargs=parse_kwargs(args.kwargs), samples=None if args.all else args.samples)
    path = result.path
    if result.mismatch:
        print(f"mmapcache: mismatch: {result.mismatch}", file=sys.stderr)
    for problem in result.problems:
        print(f"mmapcache: damage: {problem}", file=sys.stderr)
    for difference in result.differences[:20]:
        print(f"mmapcache: differs: {difference}", file=sys.stderr)
    if len(result.differences) > 20:
        print(f"mmapcache: ... and {len(result.differences) - 20} more differences", file=sys.stderr)
    compared = f", {result.compared} compared with the source" if dataset is not None else \
        " (format only; pass --source to compare samples)"
    if result.uncomparable:
        compared = f" (format only: {result.uncomparable}, so samples cannot be compared with a source)"
    interrupted = f", {result.interrupted} interrupted mid-write (will be refilled)" if result.interrupted else ""
    verdict = "ok" if result.ok else "another source" if result.mismatch else \
        f"{len(result.problems)} problem(s), {result.differing} difference(s)"
    print(f"{path}: {verdict}: {result.filled} of {result.rows} rows filled{interrupted}{compared}")
    for recount in result.recounts:
        print(f"mmapcache: note: {recount} (not damage)")
    if result.changed_layout:
        print(f"mmapcache: the source's samples are not the cache's (another shape or type): the source or its "
              f"preprocessing changed since the cache was built. Build the cache again from it (`mmapcache rm "
              f"{path}`, then `mmapcache build`; or open it with overwrite=True); if the field's shape varies from "
              "sample to sample, build it with --ragged FIELD", file=sys.stderr)
    elif result.differences and result.stream:
        print("mmapcache: a stream's rows are computed afresh every lap, so a source that augments at random differs "
              "from them every time (that is what a stream serves): only a deterministic source can be compared. "
              "Create the stream with deterministic=False (MmapCachedDataset(..., stream=True, deterministic=False)) "
              "to record that its source is not, and verify then checks its files only", file=sys.stderr)
    elif result.differences:
        print("mmapcache: rebuild the differing samples: `mmapcache rm` the cache and build it again, or refresh them "
              "(MmapCachedDataset.refresh(indices=...)) and run `mmapcache build`", file=sys.stderr)
    return 0 if result.ok else 1


def _cmd_gc(args: argparse.Namespace) -> int:
    from .. import gc

    directory = existing_dir(args.dir)
    removed = gc(directory)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print(f"nothing to remove in {directory}")
    return 0
