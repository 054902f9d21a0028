"""The ``mmapcache`` command line: build, inspect, ls, rm, verify, gc.

``main(argv=None) -> int`` parses the arguments (stdlib argparse) and calls library functions: the command line is
a client of the public API (``mmapcache.build``, ``verify``, ``describe``...), never of its internals. User errors
(bad arguments, missing or damaged caches, unimportable specs) print one ``mmapcache: error: ...`` line to stderr
and return 2; ``--debug`` shows the traceback instead. Torch is imported only by the commands that need a dataset
(build, verify --source), so inspect, ls, rm and gc start fast. One module per group of subcommands: ``build``,
``show`` (inspect, ls), ``manage`` (verify, rm, gc); ``args`` holds the parser and argument types.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence

from .. import MmapCacheError, UsageError, __version__
from . import build, manage, show
from .args import PROG, Parser, formatter

__all__ = ["main"]

_EXIT_USAGE = 2
_EXIT_SIGPIPE = 128 + 13  # what a shell reports for a tool killed by SIGPIPE


def _parser() -> Parser:
    parser = Parser(
        prog=PROG, formatter_class=formatter,
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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    common = Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks of errors")

    def add(name: str, help: str, example: str, description: str = "") -> Parser:
        return sub.add_parser(name, help=help, parents=[common], formatter_class=formatter,
                              description=description or help, epilog="example:\n" + textwrap.indent(example, "  "))

    for group in (build, show, manage):
        group.register(add)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 failures or differences, 2 usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        parser = _parser()
        args, extras = parser.parse_known_args(argv)
        if extras:
            # argparse reports these from the top-level parser; the fix is in the subcommand's help.
            raise UsageError(f"unrecognized arguments: {' '.join(extras)} (see `{PROG} {args.command} --help`)")
        run: Callable[[argparse.Namespace], int] = args.run
        return run(args)
    except SystemExit as exc:  # --help, or argparse's own exit
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else _EXIT_USAGE)
    except KeyboardInterrupt:
        print("mmapcache: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`mmapcache ls | head -1`): stop quietly, as a Unix tool killed by
        # SIGPIPE does, and keep the interpreter's final flush from reporting the same pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _EXIT_SIGPIPE
    except (UsageError, MmapCacheError, OSError) as exc:
        if debug:
            traceback.print_exc()
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return _EXIT_USAGE
    except (TypeError, ValueError) as exc:
        # Library validation of user-supplied values (sizes, options); a bug would show with --debug.
        if debug:
            traceback.print_exc()
        print(f"{PROG}: error: {' '.join(str(exc).split())} (--debug shows the traceback)", file=sys.stderr)
        return _EXIT_USAGE
