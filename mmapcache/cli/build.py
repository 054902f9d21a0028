"""``mmapcache build``: create a cache if needed and fill it in parallel (or produce a stream)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from ..errors import UsageError
from .args import Add, fraction, index_range, parse_kwargs, positive_int, shard

__all__ = ["register"]


def register(add: Add) -> None:
    """Adds this module's subcommands (``add`` makes a subparser: name, help, example, description)."""
    p = add("build", "create a cache if needed and fill it in parallel",
            "mmapcache build imagenet-224 --dataset mypkg.data:ImageNet \\\n"
            "    --kwargs '{\"root\": \"/data/imagenet\", \"size\": 224}' --workers 16 --max-bytes 64G\n"
            "torchrun --nproc-per-node 8 -m mmapcache build imagenet-224 --dataset mypkg.data:ImageNet",
            description=textwrap.dedent("""\
                Create the cache at PATH if it is missing, then fill every row that is not filled yet (or is stale)
                with --workers processes, each building its own copy of the dataset from --dataset. Safe to
                interrupt (Ctrl-C, kill -9) and rerun: it fills only what is missing. Safe next to other builds
                and training processes on the same cache: workers claim chunks of rows, so no sample is
                computed twice on purpose.

                --shard I/N fills chunks c (runs of consecutive rows) with c % N == I: N disjoint parts that
                together cover the cache. Under torchrun (LOCAL_RANK and LOCAL_WORLD_SIZE set) each local rank
                takes its part automatically.

                Exit status: 0 complete (with --follow: stopped by SIGINT or SIGTERM), 1 some samples failed (listed),
                2 usage error, 130 interrupted."""))
    p.add_argument("path", metavar="PATH", help="cache directory, or a bare name under $MMAPCACHE_DIR")
    p.add_argument("--dataset", required=True, metavar="SPEC",
                   help="'package.module:name' or 'path/to/file.py:name': a Dataset class or factory")
    p.add_argument("--kwargs", metavar="JSON", help="keyword arguments for SPEC, a JSON object")
    p.add_argument("--workers", type=positive_int, metavar="N", help="worker processes (default: usable CPUs)")
    p.add_argument("--shard", type=shard, metavar="I/N", help="fill only the I-th of N disjoint parts")
    p.add_argument("--fingerprint", metavar="STR", help="identification of the source, checked on reuse")
    p.add_argument("--indices", type=index_range, metavar="A:B", help="only source indices A <= i < B")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first sample that raises")
    p.add_argument("--max-bytes", metavar="SIZE",
                   help="on creation, cache only the samples that fit (e.g. 8G)")
    p.add_argument("--variants", type=positive_int, metavar="K",
                   help="on creation, store K versions of each sample (the source is called K times)")
    p.add_argument("--max-shapes", metavar="JSON",
                   help="on creation, {field path: max shape} for fields whose shape varies, "
                        "e.g. '{\"0\": [3, 512, 512]}'")
    p.add_argument("--ragged", metavar="FIELDS", default="auto",
                   help="on creation, fields whose shape varies, packed at each value's size: 'auto' (default: found "
                        "from 8 samples), field paths, e.g. 'input_ids,boxes', or 'none' (every field keeps the first "
                        "sample's shape)")
    p.add_argument("--store-as", metavar="FIELD=TYPE,...",
                   help="on creation, ragged fields stored narrower than the source's dtype and read back in it, "
                        "e.g. 'input_ids=int32,attention_mask=ones' (ones: a field of all ones, only its shapes "
                        "stored); a value that does not fit fails, naming it")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="on creation, record whether the source returns the same sample for an index every time "
                        "(default); --no-deterministic for random augmentation: openers then compare layouts, not "
                        "bytes, and verify compares nothing")
    p.add_argument("--refresh", type=fraction, metavar="FRACTION",
                   help="first mark this fraction of filled rows stale, then refill them")
    p.add_argument("--seed", type=int, metavar="N",
                   help="seed of --refresh's choice of rows (default: a fresh one each run, printed)")
    p.add_argument("--node-share", action="store_true",
                   help="under torchrun or SLURM: this node caches (and fills) only its share of the dataset (a "
                        "stream made under a job of several nodes always holds its node's ranks' part)")
    p.add_argument("--rotate-every", type=positive_int, metavar="E",
                   help="with --node-share: the partition is drawn again every E epochs")
    p.add_argument("--share-seed", type=int, default=0, metavar="N",
                   help="with --node-share: the partition's seed (MmapCachedDataset's seed=; default 0)")
    p.add_argument("--stream", action="store_true",
                   help="create a stream (ring of --max-bytes, default 4096 samples) if none exists; an existing "
                        "stream is produced for as it is. Needs --follow. Under torchrun or SLURM, the stream of a job "
                        "of several nodes holds this node's part, and local rank 0 runs the node's producers")
    p.add_argument("--stream-seed", type=int, default=0, metavar="N",
                   help="with --stream: the seed of the stream's order (MmapCachedDataset's seed=; default 0)")
    p.add_argument("--check-finite", action="store_true",
                   help="refuse samples holding NaN or infinite values: each is reported as failed, not stored "
                        "(a stream's producers leave it to its reader, which raises)")
    p.add_argument("--follow", action="store_true",
                   help="keep running: refill rows that become stale or unfilled (poll 0.5 s) until SIGINT/SIGTERM")
    p.set_defaults(run=_cmd_build)



def _cmd_build(args: argparse.Namespace) -> int:
    from .. import build

    kwargs = parse_kwargs(args.kwargs)
    with _SigtermAsInterrupt():
        report = build(
            args.path, args.dataset, kwargs=kwargs, workers=args.workers, shard=args.shard or "auto",
            indices=args.indices,
            fingerprint=args.fingerprint, max_bytes=args.max_bytes, variants=args.variants,
            max_shapes=_max_shapes(args.max_shapes), refresh=args.refresh, ragged=_ragged(args.ragged),
            store_as=_store_as(args.store_as),
            follow=args.follow, fail_fast=args.fail_fast, check_finite=args.check_finite, seed=args.seed,
            progress=True,
            deterministic=args.deterministic,
            node_share=args.node_share, rotate_every=args.rotate_every, share_seed=args.share_seed,
            stream=args.stream, stream_seed=args.stream_seed,
        )
    if report.marked_stale:
        print(f"marked {report.marked_stale} rows stale for refresh (seed {report.refresh_seed})")
    print(report.summary(), flush=True)
    for line in _failure_lines(report.failed):
        print(f"mmapcache: failed: {line}", file=sys.stderr)
    if report.failed:
        what = "stopped at the first failure (--fail-fast)" if args.fail_fast else "the other samples are stored"
        print(f"mmapcache: {len(report.failed)} sample(s) failed; {what}; fix the source and rerun the same command "
              "to fill what is missing", file=sys.stderr)
        return 1
    if report.interrupted and not args.follow:
        print("mmapcache: interrupted; the cache is consistent: rerun the same command to fill what is missing",
              file=sys.stderr)
        return 130
    return 0


def _failure_lines(failures: Sequence[Any], shown: int = 20) -> list[str]:
    """One line per distinct error (the sample numbers in it masked), naming the samples that raised it: a source
    that fails the same way on 42 samples prints one line, not 42."""
    groups: dict[str, list[Any]] = {}
    for failure in failures:
        key = re.sub(r"\bsample \d+", "sample N", failure.error)
        groups.setdefault(key, []).append(failure)
    lines = []
    for same in list(groups.values())[:shown]:
        if len(same) == 1:
            lines.append(str(same[0]))
            continue
        indices = ", ".join(str(f.index) for f in same[:8]) + (", ..." if len(same) > 8 else "")
        lines.append(f"{len(same)} samples ({indices}), e.g. {same[0]}")
    if len(groups) > shown:
        lines.append(f"... and {len(groups) - shown} more distinct errors")
    return lines


def _ragged(text: str | None) -> list[str] | str | None:
    """``--ragged``: ``auto``, ``none``, or field paths separated by commas."""
    if text is None or text == "auto":
        return text
    if text == "none":
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UsageError("--ragged takes 'auto', 'none' or field paths separated by commas, e.g. --ragged "
                         "input_ids,boxes")
    return names


def _store_as(text: str | None) -> dict[str, str] | None:
    """``--store-as``: ``field=type`` pairs separated by commas."""
    if text is None:
        return None
    pairs = [part.strip().partition("=") for part in text.split(",") if part.strip()]
    if not pairs or any(not name.strip() or not sep or not how.strip() for name, sep, how in pairs):
        raise UsageError(f"--store-as takes field=type pairs separated by commas, e.g. --store-as "
                         f"input_ids=int32,attention_mask=ones; got {text!r}")
    return {name.strip(): how.strip() for name, _, how in pairs}


def _max_shapes(text: str | None) -> dict[str, list[int]] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--max-shapes is not valid JSON ({exc.msg} at column {exc.colno}); pass an object such as "
                         "'{\"image\": [3, 512, 512]}'") from None
    if not isinstance(value, dict) or not all(isinstance(v, list) and all(isinstance(d, int) for d in v)
                                              for v in value.values()):
        raise UsageError("--max-shapes must be a JSON object of field path -> list of ints, e.g. "
                         "'{\"image\": [3, 512, 512]}'")
    return value


class _SigtermAsInterrupt:
    """SIGTERM raises KeyboardInterrupt in this process while active, so a build stops like on Ctrl-C."""

    def __enter__(self) -> None:
        def interrupt(signum: int, frame: Any) -> None:
            if os.getpid() == self.pid:  # forked workers inherit the handler; they just exit
                raise KeyboardInterrupt
            os._exit(1)

        self.pid = os.getpid()
        self.previous = signal.signal(signal.SIGTERM, interrupt)

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self.previous)
