"""The ``mmapcache`` command line: build, inspect, ls, rm, verify, gc.

``main(argv=None) -> int`` parses the arguments (stdlib argparse) and calls library functions. User errors
(bad arguments, missing or damaged caches, unimportable specs) print one ``mmapcache: error: ...`` line to stderr
and return 2; ``--debug`` shows the traceback instead. Torch is imported only by the commands that need a dataset
(build, verify --source), so inspect, ls, rm and gc start fast.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from . import MmapCacheError, UsageError, __version__

__all__ = ["main"]

_PROG = "mmapcache"
_EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump), raised so ``main`` decides the exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


# --- argument types (each raises ArgumentTypeError with the fix) -------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1] (e.g. 0.1)")
    return value


def _shard(text: str) -> tuple[int, int]:
    try:
        return parse_shard(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _range(text: str) -> tuple[int, int | None]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``."""
    i, sep, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        shard = (-1, 0)
    if not sep or not 0 <= shard[0] < shard[1]:
        raise ValueError(f"shard {text!r} is not I/N with 0 <= I < N; pass e.g. 0/4 for the first of four parts")
    return shard


def parse_range(text: str) -> tuple[int, int | None]:
    """``"A:B"`` (either side may be empty) -> ``(A, B or None)`` with ``0 <= A < B``."""
    a, sep, b = text.partition(":")
    try:
        start = int(a) if a.strip() else 0
        stop = int(b) if b.strip() else None
    except ValueError:
        start, stop = -1, None
    if not sep or start < 0 or (stop is not None and stop <= start):
        raise ValueError(f"indices {text!r} is not a range A:B of source indices with 0 <= A < B; pass e.g. 0:1000")
    return start, stop


def parse_kwargs(text: str | None) -> dict[str, Any]:
    """The ``--kwargs`` JSON object as a dict (``None`` or empty: no arguments)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--kwargs is not valid JSON ({exc.msg} at column {exc.colno}); pass an object such as "
                         "'{\"root\": \"/data\", \"size\": 224}'") from None
    if not isinstance(value, dict):
        raise UsageError(f"--kwargs must be a JSON object of keyword arguments, got a JSON {type(value).__name__}; "
                         "pass e.g. '{\"size\": 224}'")
    return value


# --- the parser --------------------------------------------------------------------------------------------------


def _parser() -> _Parser:
    parser = _Parser(
        prog=_PROG, formatter_class=_formatter,
        description="Build, inspect and manage mmapcache caches (shared, file-backed copies of PyTorch datasets).",
        epilog=textwrap.dedent("""\
            examples:
              mmapcache build imagenet-224 --dataset mypkg.data:ImageNet --kwargs '{"root": "/data/imagenet"}'
              mmapcache ls
              mmapcache inspect imagenet-224
            A bare cache name resolves under $MMAPCACHE_DIR (default /dev/shm/mmapcache).
            """),
    )
    parser.add_argument("--version", action="version", version=f"mmapcache {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks of errors")

    def add(name: str, help: str, example: str, description: str = "") -> _Parser:
        return sub.add_parser(name, help=help, parents=[common], formatter_class=_formatter,
                              description=description or help, epilog="example:\n" + textwrap.indent(example, "  "))

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

                Exit status: 0 complete, 1 some samples failed (listed), 2 usage error, 130 interrupted."""))
    p.add_argument("path", metavar="PATH", help="cache directory, or a bare name under $MMAPCACHE_DIR")
    p.add_argument("--dataset", required=True, metavar="SPEC",
                   help="'package.module:name' or 'path/to/file.py:name': a Dataset class or factory")
    p.add_argument("--kwargs", metavar="JSON", help="keyword arguments for SPEC, a JSON object")
    p.add_argument("--workers", type=_positive_int, metavar="N", help="worker processes (default: usable CPUs)")
    p.add_argument("--shard", type=_shard, metavar="I/N", help="fill only the I-th of N disjoint parts")
    p.add_argument("--fingerprint", metavar="STR", help="identification of the source, checked on reuse")
    p.add_argument("--indices", type=_range, metavar="A:B", help="only source indices A <= i < B")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first sample that raises")
    p.add_argument("--max-bytes", metavar="SIZE",
                   help="on creation, cache only the samples that fit (e.g. 8G)")
    p.add_argument("--variants", type=_positive_int, metavar="K",
                   help="on creation, store K versions of each sample (the source is called K times)")
    p.add_argument("--max-shapes", metavar="JSON",
                   help="on creation, {field path: max shape} for fields whose shape varies, "
                        "e.g. '{\"0\": [3, 512, 512]}'")
    p.add_argument("--ragged", metavar="FIELDS", default="auto",
                   help="on creation, fields whose shape varies, packed at each value's size: 'auto' (default: found "
                        "from 8 samples), field paths, e.g. 'input_ids,boxes', or 'none' (every field keeps the first "
                        "sample's shape)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="on creation, record whether the source returns the same sample for an index every time "
                        "(default); --no-deterministic for random augmentation: openers then compare layouts, not "
                        "bytes, and verify compares nothing")
    p.add_argument("--refresh", type=_fraction, metavar="FRACTION",
                   help="first mark this fraction of filled rows stale, then refill them")
    p.add_argument("--seed", type=int, metavar="N",
                   help="seed of --refresh's choice of rows (default: a fresh one each run, printed)")
    p.add_argument("--node-share", action="store_true",
                   help="under torchrun or SLURM: this node caches (and fills) only its share of the dataset")
    p.add_argument("--rotate-every", type=_positive_int, metavar="E",
                   help="with --node-share: the partition is drawn again every E epochs")
    p.add_argument("--share-seed", type=int, default=0, metavar="N",
                   help="with --node-share: the partition's seed (MmapCachedDataset's seed=; default 0)")
    p.add_argument("--stream", action="store_true",
                   help="create a stream (ring of --max-bytes, default 4096 samples) if none exists; an existing "
                        "stream is produced for as it is. Needs --follow")
    p.add_argument("--stream-seed", type=int, default=0, metavar="N",
                   help="with --stream: the seed of the stream's order (MmapCachedDataset's seed=; default 0)")
    p.add_argument("--follow", action="store_true",
                   help="keep running: refill rows that become stale or unfilled (poll 0.5 s) until SIGINT/SIGTERM")
    p.set_defaults(run=_cmd_build)

    p = add("inspect", "describe a cache", "mmapcache inspect imagenet-224 --json | jq .fraction")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(run=_cmd_inspect)

    p = add("ls", "list the caches in a directory", "mmapcache ls /dev/shm/mmapcache")
    p.add_argument("dir", nargs="?", metavar="DIR", help="default: $MMAPCACHE_DIR or /dev/shm/mmapcache")
    p.add_argument("--json", action="store_true", help="a JSON list")
    p.set_defaults(run=_cmd_ls)

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

                Exit status: 0 clean, 1 damage or differences found, 2 usage error."""))
    p.add_argument("path", metavar="PATH")
    p.add_argument("--source", metavar="SPEC", help="the dataset the cache was built from")
    p.add_argument("--kwargs", metavar="JSON", help="keyword arguments for SPEC, a JSON object")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--samples", type=_positive_int, default=100, metavar="K",
                       help="recompute K random filled samples (default 100)")
    group.add_argument("--all", action="store_true", help="recompute every filled sample")
    p.set_defaults(run=_cmd_verify)

    p = add("gc", "remove leftovers of dead processes (temporary directories, orphaned delete_on_close caches)",
            "mmapcache gc /dev/shm/mmapcache")
    p.add_argument("dir", nargs="?", metavar="DIR", help="default: $MMAPCACHE_DIR or /dev/shm/mmapcache")
    p.set_defaults(run=_cmd_gc)
    return parser


# --- commands ----------------------------------------------------------------------------------------------------


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


def _existing_dir(directory: str | None) -> str:
    from . import cache_root

    directory = os.path.abspath(directory or cache_root())
    if not os.path.exists(directory):
        return directory
    if not os.path.isdir(directory):
        raise UsageError(f"{directory} is a file, not a directory of caches; pass a directory")
    return directory


def _cmd_build(args: argparse.Namespace) -> int:
    from . import build

    kwargs = parse_kwargs(args.kwargs)
    with _SigtermAsInterrupt():
        report = build(
            args.path, args.dataset, kwargs=kwargs, workers=args.workers, shard=args.shard or "auto",
            indices=args.indices,
            fingerprint=args.fingerprint, max_bytes=args.max_bytes, variants=args.variants,
            max_shapes=_max_shapes(args.max_shapes), refresh=args.refresh, ragged=_ragged(args.ragged),
            follow=args.follow, fail_fast=args.fail_fast, seed=args.seed, progress=True,
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


def _cmd_inspect(args: argparse.Namespace) -> int:
    from . import describe

    info = describe(args.path)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(_render(info))
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    from . import list_caches

    directory = _existing_dir(args.dir)
    entries = list_caches(directory)
    if args.json:
        print(json.dumps(entries, indent=1))
    elif entries:
        print(_render_list(entries))
    else:
        print(f"no caches in {directory}", file=sys.stderr)
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    from . import remove

    for path in remove(*args.paths, force=args.force):
        print(f"removed {path}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from . import verify

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
        f"{len(result.problems)} problem(s), {len(result.differences)} difference(s)"
    print(f"{path}: {verdict}: {result.filled} of {result.rows} rows filled{interrupted}{compared}")
    if result.differences:
        print("mmapcache: rebuild the differing samples: `mmapcache rm` the cache and build it again, or refresh them "
              "(MmapCachedDataset.refresh(indices=...)) and run `mmapcache build`", file=sys.stderr)
    return 0 if result.ok else 1


def _cmd_gc(args: argparse.Namespace) -> int:
    from . import gc

    directory = _existing_dir(args.dir)
    removed = gc(directory)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print(f"nothing to remove in {directory}")
    return 0


# --- presentation ------------------------------------------------------------------------------------------------


def _render(info: dict[str, Any]) -> str:
    """``describe``'s result as aligned text lines."""
    slots = f"{info['slots']} of {info['length']} ({100 * info['slot_fraction']:.1f}%)"
    fields = [_render_field(f) for f in info["fields"]]
    users = ", ".join(map(str, info["users"])) or "none"
    lines = [
        ("path", info["path"]),
        ("format", f"version {info['format_version']} (written by mmapcache {info['library_version']})"),
        ("length", str(info["length"])),
        *([("cacheable", slots)] if info.get("mode") != "stream" else []),
        *([("share", info["share"]["text"])] if info.get("share") else []),
        *(_stream_lines(info["stream"]) if info.get("stream") else []),
        ("variants", str(info["variants"])),
        ("filled", f"{info['filled']} of {info['rows']} rows ({100 * info['fraction']:.1f}%)"),
        ("stale", str(info["stale"])),
        ("size", f"{info['size']} on disk, {info['free']} free on its file system"),
        ("fingerprint", str(info["fingerprint"])),
        ("created", str(info["created"])),
        ("users", users),
        ("fields", fields[0] if fields else ""),
    ]
    width = max(len(k) for k, _ in lines) + 1
    text = [f"{k + ':':<{width}} {v}" for k, v in lines]
    text += [f"{'':<{width}} {f}" for f in fields[1:]]
    if info.get("mode") != "stream":  # a stream's rows hold positions of its order: no map by index
        text.append(f"{'fill map:':<{width}} |{info['fill_map']}|  (index 0 ... {info['length'] - 1})")
        text.append(f"{'':<{width}} one character per range of indices: ' ' empty, '.:-=+*#%' partly filled (more to "
                    "the right), '@' full, '_' not cacheable")
    return "\n".join(text)


def _stream_lines(stream: dict[str, Any]) -> list[tuple[str, str]]:
    readers = ", ".join(f"rank {rank} at epoch {epoch} position {k}" for rank, (epoch, k) in stream["readers"].items())
    producers = ", ".join(map(str, stream["producers"])) or "none running"
    return [
        ("stream", f"seed {stream['seed']}, a ring of {stream['slots']} samples; {stream['ahead']} ready ahead of the "
                   "slowest reader"),
        ("produced", f"{stream['produced']} ({stream['skipped']} too late for their reader); served "
                     f"{stream['served']} fresh from the ring, {stream['computed']} computed by readers, "
                     f"{stream['waited']:.1f} s waited"),
        ("producers", producers),
        ("readers", readers or "none yet"),
    ]


def _render_field(field: dict[str, Any]) -> str:
    if field["kind"] == "json":  # a tensor subclass's attributes, a field of their own
        return f"{field['name']}: the attributes of {field['name'].removesuffix('#meta')!r} (JSON, ragged)"
    shape = "x".join("*" if d < 0 else str(d) for d in field["shape"]) or "scalar"
    text = f"{field['name']}: {field['kind']} {field['dtype']} {shape}"
    if field["variable"]:
        text += " (max, variable)"
    heap = field.get("heap")
    if heap is not None:
        text += f" (ragged: {heap['text']})"
    return text


def _render_list(entries: list[dict[str, Any]]) -> str:
    """``list_caches``'s result as an aligned table."""
    # CACHEABLE: the share of samples the cache can hold (max_bytes/cache_indices); FILLED: the share of those
    # (all their variants) already stored. A full partial cache reads "76.6%  100.0%", never a bare "100.0%".
    table = [("NAME", "LENGTH", "CACHEABLE", "FILLED", "SIZE", "USERS")]
    for e in entries:
        users = ",".join(map(str, e["users"])) or "-"
        if "error" in e:
            table.append((e["name"], "?", "-", "damaged", e["size"], users))
        else:
            table.append((e["name"], str(e["length"]), f"{100 * e['cacheable']:.1f}%", f"{100 * e['fraction']:.1f}%",
                          e["size"], users))
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = []
    for row in table:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:-1], widths[1:-1])] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# --- entry point -------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 failures or differences, 2 usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        parser = _parser()
        args, extras = parser.parse_known_args(argv)
        if extras:
            # argparse reports these from the top-level parser; the fix is in the subcommand's help.
            raise UsageError(f"unrecognized arguments: {' '.join(extras)} (see `{_PROG} {args.command} --help`)")
        run: Callable[[argparse.Namespace], int] = args.run
        return run(args)
    except SystemExit as exc:  # --help, or argparse's own exit
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else _EXIT_USAGE)
    except KeyboardInterrupt:
        print("mmapcache: interrupted", file=sys.stderr)
        return 130
    except (UsageError, MmapCacheError, OSError) as exc:
        if debug:
            traceback.print_exc()
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{_PROG}: error: {message}", file=sys.stderr)
        return _EXIT_USAGE
    except (TypeError, ValueError) as exc:
        # Library validation of user-supplied values (sizes, options); a bug would show with --debug.
        if debug:
            traceback.print_exc()
        print(f"{_PROG}: error: {' '.join(str(exc).split())} (--debug shows the traceback)", file=sys.stderr)
        return _EXIT_USAGE
