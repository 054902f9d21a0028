"""The damage fuzzer's child process: runs cases one after another, reporting each step over a pipe.

``python -m helpers.fuzz_child --root ROOT --seed S --kinds fixed,ragged --cases K:M --fd FD`` runs cases ``K ..
M-1`` (or a list ``--cases 3,7``) until ``--deadline``, a wall-clock time. A case copies the pristine cache of its kind
(``ROOT/pristine/<kind>/cache``, built by the test) to ``ROOT/work/cache``, damages one file (``fuzz_damage``),
then goes through the steps a user's processes would take (``Case.run``), checking after each step that the
cache's files kept their sizes (only heaps grow), none became sparse, nothing was written beside the cache, and
read-only steps wrote nothing. The oracle is ``fuzz_oracle.Verdicts``.

Reports are JSON lines on ``FD``: ``{"case", "event": "start", "kind", "damage"}``, ``{"case", "event": "step",
"step"}`` before each step (so the parent names the step a hang or a signal interrupted), and ``{"case", "event":
"done", "violations": [...]}``. A hang or a death by a signal is the parent's to observe.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import mmapcache
from helpers.fuzz_caches import KINDS, Kind, keep
from helpers.fuzz_damage import Context, Damage, apply, choose
from helpers.fuzz_oracle import Verdicts, batch_equal, clean, role
from helpers.sources import sample_equal
from mmapcache import (
    CacheFormatError,
    CacheMismatchError,
    CacheReadOnlyWarning,
    DistributedOrderWarning,
    MmapCachedDataset,
    SampleNotCachedError,
    StreamBypassWarning,
    StreamPositionWarning,
    UncachedFieldWarning,
)
from mmapcache.store import heap as _heap

# Bounds on what a damaged cache can make this process do: files past 1.5 GiB fail with EFBIG instead of
# filling tmpfs (a sparse write at 2**30 still shows), and the address space is capped so a huge allocation
# asked for by a damaged shape is a MemoryError, not the machine's memory.
FILE_LIMIT = 3 << 29
MEMORY_LIMIT = 8 << 30
CLI_TIMEOUT = 60.0
_PAGE = 4096
_HASHED = 8 << 20
RING = "ring.u64"  # files up to this size are hashed to see read-only steps write nothing


def make_case(seed: int, number: int, kinds: list[str], contexts: dict[str, Context]) -> tuple[str, Damage]:
    """Case ``number`` of ``seed``: its kind (round robin), the file it damages (each of the kind's files in turn
    in the first rounds: every file is hit by the first ``sweep_cases`` cases, then drawn) and the damage (from the
    case's own generator)."""
    rng = random.Random(f"{seed}:{number}")
    kind = kinds[number % len(kinds)]
    return kind, choose(contexts[kind], rng, sweep=number // len(kinds))


class Case:
    """One damaged copy of a cache, and the steps run on it. ``verdicts`` collects what went wrong."""

    def __init__(self, number: int, kind: Kind, damage: Damage, root: str, emit: Callable[..., None],
                 baseline: dict[str, list[str]], expected: Callable[[Kind, int, int], Any], cli: bool) -> None:
        self.number, self.kind, self.damage, self.emit = number, kind, damage, emit
        self.base = os.path.join(root, "work")
        self.path = os.path.join(self.base, "cache")
        self.pristine = os.path.join(root, "pristine", kind.name, "cache")
        self.expected = expected
        self.cli = cli
        self.source = kind.source()
        self.verdicts = Verdicts(kind.name, damage, baseline)
        self.step = "setup"
        self.sizes: dict[str, tuple[int, int]] = {}
        # CacheMismatchError is right for a meta.json that describes another valid cache, and for damage to a stored
        # sample an opener compares with its source (it cannot tell damage from another source: either way the
        # cache is not this source's); the oracle then holds it to what verify reports, as for CacheFormatError.
        self.mismatch: tuple[type[BaseException], ...] = (CacheMismatchError,)

    # --- the steps ---------------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        shutil.rmtree(self.base, ignore_errors=True)
        os.makedirs(self.base)
        shutil.copytree(self.pristine, self.path)
        with open(os.path.join(self.base, "canary"), "wb") as f:
            f.write(b"canary" * 1000)
        apply(self.path, self.damage)
        self.sizes = self._stat()
        for name, (size, blocks) in self.sizes.items():
            if blocks * 512 < size // _PAGE * _PAGE:
                raise AssertionError(f"fuzzer: {name} is sparse before any step (the copy or the damage made it so)")
        formats = (CacheFormatError, *self.mismatch)
        with self.phase("verify", readonly=True):
            before = self.call(lambda: mmapcache.verify(self.path, self.source, samples=None), formats)
            plain = self.call(lambda: mmapcache.verify(self.path), formats)
        self.verdicts.verified("before", before, plain, self.path)
        with self.phase("cli verify (in-process)", readonly=True):
            self.verdicts.cli(self.step, self._cli_in_process())
        if self.cli:
            with self.phase("cli verify (python -m mmapcache)", readonly=True):
                self.verdicts.cli(self.step, self._cli_subprocess())
        with self.phase("describe", readonly=True):
            self.call(lambda: mmapcache.describe(self.path), formats)
        with self.phase("open with the source"):
            _selftest(self.number)
            ds = self.call(lambda: MmapCachedDataset(self.path, self.source, **self.kind.options), formats)
        if ds is not None:
            self.reads(ds, "before", formats)
        with self.phase("open without a source", readonly=True):
            bare = self.call(lambda: MmapCachedDataset(self.path), formats)
        if bare is not None:
            self.reads(bare, "before", (*formats, SampleNotCachedError), readonly=True)
            with self.phase("close without a source", readonly=True):
                self.call(bare.close, ())
        if ds is not None:
            with self.phase("write: refresh(fraction=0.5) + fill()"):
                self.writes(ds, formats)
            self.reads(ds, "after", formats)
            with self.phase("close"):
                self.call(ds.close, ())
        with self.phase("verify after writing", readonly=True):
            after = self.call(lambda: mmapcache.verify(self.path, self.source, samples=None), formats)
            self.call(lambda: mmapcache.describe(self.path), formats)
        self.verdicts.verified("after", after, None, self.path)
        self.verdicts.judge()
        shutil.rmtree(self.base, ignore_errors=True)
        return self.verdicts.violations()

    def reads(self, ds: MmapCachedDataset, when: str, allowed: tuple[type[BaseException], ...],
              readonly: bool = False) -> None:
        """Every index one at a time, then every index in one ``__getitems__``, then the loader's batches, in each
        of the kind's epochs."""
        source = "" if ds.dataset is not None else " (no source)"
        # A cache opened without its source has the length meta.json says.
        length = self.call(lambda: len(ds), allowed, result=True)
        if length is _FAILED:
            return
        n = min(length, len(self.source))
        for epoch in self.kind.epochs:
            with self.phase(f"ds[i] for every i{source}, epoch {epoch}, {when} writing", readonly):
                self.set_epoch(ds, epoch)
                for i in range(n):
                    got = self.call(lambda: ds[i], allowed, result=True)
                    if got is not _FAILED:
                        self.check(when, f"ds[{i}] epoch {epoch}", got, self.expected(self.kind, epoch, i))
            with self.phase(f"ds.__getitems__(all){source}, epoch {epoch}, {when} writing", readonly):
                got = self.call(lambda: ds.__getitems__(list(range(n))), allowed, result=True)
                if got is not _FAILED:
                    for i, sample in enumerate(got):
                        self.check(when, f"__getitems__[{i}] epoch {epoch}", sample,
                                   self.expected(self.kind, epoch, i))
            with self.phase(f"ds.loader(batch_size=5){source}, epoch {epoch}, {when} writing", readonly):
                if self.kind.stream:
                    self.stream_batches(ds, when, allowed)
                else:
                    self.batches(ds, when, epoch, allowed)
        self.set_epoch(ds, 0)

    def set_epoch(self, ds: MmapCachedDataset, epoch: int) -> None:
        """The dataset's epoch, and the source's (which ``verify`` moves to each variant it compares)."""
        self.call(lambda: ds.set_epoch(epoch), ())
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def batches(self, ds: MmapCachedDataset, when: str, epoch: int, allowed: tuple[type[BaseException], ...]) -> None:
        got = self.call(lambda: list(ds.loader(batch_size=5, collate_fn=self.kind.collate)), allowed, result=True)
        if got is _FAILED:
            return
        for b, batch in enumerate(got):
            samples = [self.expected(self.kind, epoch, i) for i in range(5 * b, min(5 * b + 5, len(self.source)))]
            self.check(when, f"loader batch {b} epoch {epoch}", batch, samples, batched=self.kind.collate is not keep)

    def stream_batches(self, ds: MmapCachedDataset, when: str, allowed: tuple[type[BaseException], ...]) -> None:
        """A stream's loader: each batch must be the positions the rank's cursor says it was handed."""
        from mmapcache.store.ring import epoch_order

        def read() -> list[tuple[Any, tuple[int, int] | None]]:
            out = []
            for batch in ds.loader(batch_size=5, rank=0, world_size=1):
                out.append((batch, ds._ring.progress(0) if ds._ring is not None else None))
            return out

        got = self.call(read, allowed, result=True)
        if got is _FAILED:
            return
        for b, (batch, progress) in enumerate(got):
            if progress is None:
                self.verdicts.harness(self.step, "a stream batch was handed out and no progress recorded")
                continue
            epoch, k = progress
            size = len(batch["i"])
            order = epoch_order(self.kind.options["seed"], epoch, len(self.source))
            indices = order[max(0, k - size):k].tolist()
            samples = [self.expected(self.kind, 0, i) for i in indices]
            self.check(when, f"stream batch {b} (epoch {epoch}, positions up to {k})", batch, samples, batched=True)

    def writes(self, ds: MmapCachedDataset, allowed: tuple[type[BaseException], ...]) -> None:
        for epoch in self.kind.epochs:
            self.set_epoch(ds, epoch)
            self.call(lambda: ds.refresh(fraction=0.5), allowed)
            self.call(ds.fill, allowed)
        self.set_epoch(ds, 0)
        if self.kind.stream:
            from helpers.fuzz_caches import _After
            from mmapcache.fill.producer import produce

            self.call(lambda: produce(self.path, self.kind.source, _After(4)), allowed)

    def check(self, when: str, what: str, got: Any, expected: Any, batched: bool = False) -> None:
        try:
            equal = batch_equal(got, expected) if batched else (
                all(sample_equal(g, e) for g, e in zip(got, expected)) and len(got) == len(expected)
                if isinstance(expected, list) else sample_equal(got, expected))
        except Exception as exc:  # a comparison that fails is a wrong sample of an unexpected type, or our bug
            self.verdicts.harness(self.step, f"comparing {what}: {type(exc).__name__}: {exc}")
            equal = False
        if not equal:
            self.verdicts.wrong(when, self.step, what)

    # --- running one call, and the checks after each step ------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, step: str, readonly: bool = False) -> Iterator[None]:
        self.step = step
        self.emit(event="step", step=step)
        before = self._contents() if readonly else None
        yield
        self._check_files()
        if before is not None:
            after = self._contents()
            if self.kind.stream and "loader" in step:  # reading a stream moves the reader's cursor: a write
                before.pop(RING, None)
                after.pop(RING, None)
            changed = sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))
            if changed:
                self.verdicts.add("a read-only step wrote to the cache", step, None, None,
                                  f"changed: {', '.join(changed)}", group=", ".join(changed))

    def call(self, fn: Callable[[], Any], allowed: tuple[type[BaseException], ...], result: bool = False) -> Any:
        """``fn()``; an exception of ``allowed`` is an accepted outcome (noted), any other one a violation."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                # Advice, not damage: a read of a node share's whole dataset without its sampler, and a stream
                # read again from an epoch its reader has passed, are what the steps do on purpose.
                for category in (UncachedFieldWarning, CacheReadOnlyWarning, StreamBypassWarning,
                                 DistributedOrderWarning, StreamPositionWarning):
                    warnings.simplefilter("ignore", category)
                return fn()
        except allowed as exc:
            self.verdicts.accepted(self.step, exc)
        except Exception as exc:
            self.verdicts.exception(self.step, exc)
        return _FAILED if result else None

    def _stat(self) -> dict[str, tuple[int, int]]:
        out = {}
        for entry in os.scandir(self.path):
            st = entry.stat(follow_symlinks=False)
            out[entry.name] = (st.st_size, st.st_blocks)
        return out

    def _check_files(self) -> None:
        """Sizes: only heaps grow, nothing shrinks, no file appears or goes; no file became sparse; the cache's
        parent holds only the cache and the canary, which is intact."""
        now = self._stat()
        for name in sorted(set(now) | set(self.sizes)):
            if name not in now or name not in self.sizes:
                self.verdicts.add("a cache file appeared or vanished", self.step, None, None,
                                  f"{name} {'vanished' if name not in now else 'appeared'}", group=name)
                continue
            (size, blocks), (old, old_blocks) = now[name], self.sizes[name]
            if size != old and not (name.endswith(".heap") and size > old):
                self.verdicts.add("a file changed size (only heaps may grow)", self.step, None, None,
                                  f"{name}: {old} -> {size} bytes", group=role(name))
            if name.endswith(".heap") and size > old and size != self._capacity(name):
                self.verdicts.add("a heap grew past its reserved capacity (a write past its end)", self.step, None,
                                  None, f"{name}: {old} -> {size} bytes, capacity {self._capacity(name)}",
                                  group=role(name))
            if blocks * 512 < size // _PAGE * _PAGE and not old_blocks * 512 < old // _PAGE * _PAGE:
                self.verdicts.add("a file became sparse (written past its reserved size)", self.step, None, None,
                                  f"{name}: {size} bytes, {blocks * 512} allocated", group=role(name))
        self.sizes = now
        entries = sorted(os.listdir(self.base))
        if entries != ["cache", "canary"]:
            self.verdicts.add("a file beside the cache was made or removed", self.step, None, None,
                              f"the cache's parent holds {entries}")
        with open(os.path.join(self.base, "canary"), "rb") as f:
            if f.read() != b"canary" * 1000:
                self.verdicts.add("a file outside the cache was written", self.step, None, None, "the canary changed")

    def _capacity(self, heap: str) -> int | None:
        """The capacity ``heaps.u64`` records for ``heap`` (the pristine's field order), None if unreadable."""
        with open(os.path.join(self.pristine, "meta.json")) as f:
            heaps = [field["heap"] for field in json.load(f)["fields"] if field["heap"]]
        with open(os.path.join(self.path, "heaps.u64"), "rb") as f:
            words = f.read()
        if heap not in heaps or len(words) != 8 * _heap.BLOCK * len(heaps):
            return None
        number = heaps.index(heap)
        return int.from_bytes(words[8 * (number * _heap.BLOCK + _heap.CAPACITY):][:8], "little")

    def _contents(self) -> dict[str, str]:
        out = {}
        for name, (size, _) in self._stat().items():
            if size > _HASHED:
                out[name] = f"{size} bytes"
                continue
            with open(os.path.join(self.path, name), "rb") as f:
                out[name] = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
        return out

    # --- the command line ----------------------------------------------------------------------------------------

    def _cli_in_process(self) -> int | str:
        from mmapcache.cli import main

        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            try:
                return main(["verify", self.path])
            except Exception as exc:
                self.verdicts.exception(self.step, exc)
                return "raised"

    def _cli_subprocess(self) -> int | str:
        try:
            out = subprocess.run([sys.executable, "-m", "mmapcache", "verify", self.path], capture_output=True,
                                 timeout=CLI_TIMEOUT, text=True, check=False)
        except subprocess.TimeoutExpired:
            return "timed out"
        if out.returncode not in (0, 1, 2) or "Traceback" in out.stderr:
            self.verdicts.add("the CLI crashed", self.step, None, None,
                              f"exit {out.returncode}: {out.stderr.strip()[-400:]}")
        return out.returncode


_FAILED = object()


# --- the process -----------------------------------------------------------------------------------------------


class Expected:
    """The source's samples, computed once per (kind, variant, index) for every case of this process."""

    def __init__(self) -> None:
        self.sources: dict[str, Any] = {}
        self.samples: dict[tuple[str, int, int], Any] = {}

    def __call__(self, kind: Kind, epoch: int, index: int) -> Any:
        key = (kind.name, epoch % 2, index)
        if key not in self.samples:
            source = self.sources.setdefault(kind.name, kind.source())
            if hasattr(source, "set_epoch"):
                source.set_epoch(epoch)
            self.samples[key] = source[index]
        return self.samples[key]


def baselines(root: str, kinds: list[str]) -> dict[str, list[str]]:
    """What verify with the source says of each pristine cache (ideally nothing), with the path left out."""
    out = {}
    for name in kinds:
        path = os.path.join(root, "pristine", name, "cache")
        result = mmapcache.verify(path, KINDS[name].source(), samples=None)
        out[name] = clean(result, path)
    return out


def _selftest(number: int) -> None:
    """``MMAPCACHE_FUZZ_SELFTEST=hang:3,segv:5`` makes case 3 hang and case 5 die of SIGSEGV while it opens the
    cache: how the driver's handling of both is tested (it must name the case and step, and go on)."""
    for item in filter(None, os.environ.get("MMAPCACHE_FUZZ_SELFTEST", "").split(",")):
        what, case = item.split(":")
        if int(case) == number and what == "hang":
            time.sleep(3600)
        if int(case) == number and what == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)


def parse_cases(text: str) -> list[int]:
    if ":" in text:
        first, last = text.split(":")
        return list(range(int(first), int(last)))
    return [int(n) for n in text.split(",") if n]


def _limit() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death: the library sees an error
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--kinds", required=True)
    parser.add_argument("--cases", required=True, help="case numbers: 'A:B' (A .. B-1) or 'A,B,C'")
    parser.add_argument("--deadline", type=float, default=float("inf"))
    parser.add_argument("--cli-every", type=int, default=1)
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    _limit()
    kinds = args.kinds.split(",")
    contexts = {name: Context.of(os.path.join(args.root, "pristine", name, "cache")) for name in kinds}
    baseline = baselines(args.root, kinds)
    expected = Expected()
    out = os.fdopen(args.fd, "w", buffering=1)
    for number in parse_cases(args.cases):
        if time.time() > args.deadline:
            break
        kind, damage = make_case(args.seed, number, kinds, contexts)

        def emit(**event: Any) -> None:
            out.write(json.dumps({"case": number, **event}) + "\n")

        emit(event="start", kind=kind, damage=damage.to_json())
        started = time.monotonic()
        case = Case(number, KINDS[kind], damage, args.root, emit, baseline[kind], expected,
                    cli=args.cli_every > 0 and number % args.cli_every == 0)
        try:
            violations = case.run()
        except Exception as exc:  # the harness's own bug: reported as such, and the next case runs
            case.verdicts.harness(case.step, "".join(traceback.format_exception(exc))[-1500:])
            violations = case.verdicts.violations()
        emit(event="done", violations=violations, seconds=round(time.monotonic() - started, 3))
    out.write(json.dumps({"event": "end"}) + "\n")
    out.close()


if __name__ == "__main__":
    main()
