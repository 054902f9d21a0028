"""Interleaved timing and the results of one benchmark run: sides measured in turn, ratios from their bests.

A ratio is only as good as the conditions its two sides ran in. On a shared machine the load changes from minute
to minute, so two rows measured minutes apart can differ by 2x for reasons that have nothing to do with the code.
``interleave`` runs the compared sides in turn, round after round (A B C A B C ...), keeps every time, and a ratio
is computed from the best round of each side. The 1-minute load average (``os.getloadavg``) is sampled before the
first round and after every round and recorded beside each ratio; this process itself contributes about 1.
"""

from __future__ import annotations

import cProfile
import gc
import io
import math
import os
import pstats
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmark.targets import TARGETS


@dataclass(frozen=True)
class Config:
    """What every group is run with.

    Attributes:
        batch: batch size of every loader.
        quick: a smoke run: each workload's small size, few rounds.
        scale: multiplies every workload's sample count.
        rounds: interleaved rounds per comparison (best of this many per side).
        min_time: seconds a measurement of an autoranged side lasts at least (several epochs if one is shorter).
        no_stocaching: skip the stocaching rows.
    """

    batch: int = 256
    quick: bool = False
    scale: float = 1.0
    rounds: int = 5
    min_time: float = 0.5
    no_stocaching: bool = False

    def size(self, full: int, quick: int) -> int:
        """A sample count: ``full`` (or ``quick`` with ``--quick``) times ``scale``, at least 1."""
        return max(1, round((quick if self.quick else full) * self.scale))


@dataclass(frozen=True)
class Timed:
    """What a side may return when it times itself: ``count`` units in ``seconds`` (a cold epoch whose clean-up
    must not count, a subprocess that reports its own fill phase, a run bounded by time rather than by work)."""

    count: float
    seconds: float


@dataclass
class Side:
    """One thing measured: ``run()`` does one unit of work (an epoch) and returns None (then it is timed around
    the call and did ``count`` units) or a ``Timed``.

    ``autorange``: repeat ``run()`` within one measurement until it lasts ``min_time`` (calibrated on the warm-up
    round), so that a 10 ms epoch is not timed alone. Off for runs that must be one each (a cold first epoch).
    """

    name: str
    run: Callable[[], Timed | None]
    count: float = 1.0
    autorange: bool = True


@dataclass
class Measured:
    """One side's rounds: ``(count, seconds)`` per round, in order, the calls per round, and per round the share of
    the wall time this process spent on a CPU (None for sides that time themselves). For a single-threaded side a
    share well under 1 says the round was descheduled: the machine was busy just then, whatever the load average
    (a 1-minute mean) says."""

    name: str
    rounds: list[tuple[float, float]] = field(default_factory=list)
    reps: int = 1
    cpu_shares: list[float | None] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [count / seconds for count, seconds in self.rounds]

    @property
    def best_rate(self) -> float:
        return max(self.rates)

    @property
    def best_cpu_share(self) -> float | None:
        return self.cpu_shares[self.rates.index(self.best_rate)]


@dataclass
class Comparison:
    """The outcome of ``interleave``: each side's rounds and the load averages sampled while they ran."""

    sides: dict[str, Measured]
    loads: list[tuple[float, float, float]]
    profiled: str | None = None  # sides run under cProfile (--profile): their times are inflated

    def rate(self, name: str) -> float:
        """Best units per second of side ``name``."""
        return self.sides[name].best_rate

    def ratio(self, a: str, b: str) -> float:
        """Best rate of ``a`` over best rate of ``b`` (> 1: ``a`` is faster). For sides doing the same work this is
        also ``b``'s best time over ``a``'s."""
        return self.rate(a) / self.rate(b)

    def load(self) -> list[float]:
        """``[lowest, highest]`` 1-minute load average seen during the measurement."""
        ones = [round(sample[0], 2) for sample in self.loads]
        return [min(ones), max(ones)]


def interleave(sides: Sequence[Side], rounds: int, *, warmup: int = 1, min_time: float = 0.0) -> Comparison:
    """Runs ``sides`` in turn for ``rounds`` rounds (A B A B ...) after ``warmup`` untimed rounds.

    The warm-up rounds also set each autoranged side's calls per measurement: enough to last ``min_time``. A full
    garbage collection precedes every measurement (outside it), so one side's garbage is not collected in
    another's time. A side selected by ``profile`` runs its measured rounds under cProfile.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    measured = {side.name: Measured(side.name) for side in sides}
    if len(measured) != len(sides):
        raise ValueError(f"side names must be distinct: {[side.name for side in sides]}")
    for _ in range(warmup):
        for side in sides:
            gc.collect()
            _, seconds, _ = _measure(side, 1)
            if side.autorange and min_time > 0:
                measured[side.name].reps = max(1, math.ceil(min_time / max(seconds, 1e-9)))
    profilers = {side.name: cProfile.Profile() for side in sides if _profiling(side.name)}
    loads = [os.getloadavg()]
    for _ in range(rounds):
        for side in sides:
            gc.collect()
            profiler = profilers.get(side.name)
            if profiler is not None:
                profiler.enable()
            count, seconds, cpu_share = _measure(side, measured[side.name].reps)
            if profiler is not None:
                profiler.disable()
            measured[side.name].rounds.append((count, seconds))
            measured[side.name].cpu_shares.append(cpu_share)
        loads.append(os.getloadavg())
    for name, profiler in profilers.items():
        _write_profile(profiler, name)
    profiled = ", ".join(profilers) or None
    return Comparison(measured, loads, profiled)


def _measure(side: Side, reps: int) -> tuple[float, float, float | None]:
    """``(count, seconds, cpu share)`` of ``reps`` calls of ``side.run``; the side's own timing wins when it returns
    one (its CPU share is then unknown: None)."""
    count = seconds = 0.0
    self_timed = False
    cpu = time.process_time()
    start = time.perf_counter()
    for _ in range(reps):
        timed = side.run()
        if timed is None:
            count += side.count
        else:
            self_timed = True
            count += timed.count
            seconds += timed.seconds
    if self_timed:
        return count, seconds, None
    seconds = time.perf_counter() - start
    return count, seconds, round((time.process_time() - cpu) / seconds, 3) if seconds > 0 else None


# --profile GROUP:SIDE,... (tools/bench.py): which sides to profile, in which groups, and where the stats go. The
# group running now is set by the orchestration (``set_group``), so the groups need not pass it to every comparison.
_profile: dict[str, Any] = {"sides": set(), "out": ""}
_group = [""]


def set_profile(sides: set[tuple[str, str]], out: str) -> None:
    """Profile these ``(group, side)`` pairs; write the stats under ``out``."""
    _profile.update(sides=set(sides), out=out)


def set_group(group: str) -> None:
    _group[0] = group


def _profiling(side: str) -> bool:
    return (_group[0], side) in _profile["sides"]


def _write_profile(profiler: cProfile.Profile, side: str) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    path = os.path.join(_profile["out"], f"profile-{_group[0]}-{side}.txt")
    os.makedirs(_profile["out"], exist_ok=True)
    with open(path, "w") as f:
        f.write(text.getvalue())
    print(f"  profile of {_group[0]}:{side} (its times are inflated by the profiler): {path}", flush=True)


def load_now() -> list[float]:
    """``[1-minute, 1-minute]`` load average: the ``load`` of a value that is not timed (bytes, memory)."""
    one = round(os.getloadavg()[0], 2)
    return [one, one]


class Results:
    """The rows (absolute numbers) and target ratios of one run, printed as they come."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.targets: list[dict[str, Any]] = []

    def row(self, group: str, name: str, value: float | None, unit: str, note: str = "",
            load: list[float] | None = None) -> None:
        self.rows.append({"group": group, "name": name, "value": value, "unit": unit, "note": note,
                          "status": "ok" if value is not None else "skipped", "load": load})
        shown = "skipped" if value is None else f"{value:,.2f} {unit}" if value < 100 else f"{value:,.0f} {unit}"
        print(f"  {name:<66} {shown:>22}  {note}", flush=True)

    def sides(self, group: str, comparison: Comparison, labels: dict[str, str], unit: str = "samples/s",
              note: str = "") -> None:
        """A row per side of ``comparison`` (its best rate), named by ``labels[side]``."""
        for name, measured in comparison.sides.items():
            calls = f", {measured.reps} epochs per round" if measured.reps > 1 else ""
            share = measured.best_cpu_share
            cpu = f", CPU share {share:.2f}" if share is not None else ""
            self.row(group, labels.get(name, name), measured.best_rate, unit,
                     f"best of {len(measured.rounds)} interleaved rounds{calls}{cpu}{'; ' + note if note else ''}",
                     comparison.load())

    def target(self, key: str, measured: float, load: list[float], note: str = "",
               sides: dict[str, Any] | None = None) -> None:
        """Records target ``key`` (declared in ``benchmark.targets``) as measured, with its verdict and load."""
        spec = TARGETS[key]
        passed = verdict(measured, spec.op, spec.required)
        self.targets.append({"id": key, "group": spec.group, "target": spec.text, "measured": float(measured),
                             "op": spec.op, "required": spec.required, "pass": passed, "load": load, "note": note,
                             "sides": sides or {}})
        print(f"  TARGET {spec.text:<62} {measured:6.3f}  required {spec.op} {spec.required:<5} "
              f"{'pass' if passed else 'MISS'}  load {load[0]:.2f}-{load[1]:.2f}", flush=True)

    def compared(self, key: str, comparison: Comparison, a: str, b: str, note: str = "") -> None:
        """Target ``key`` as ``comparison.ratio(a, b)``, keeping both sides' rounds."""
        sides = {name: {"rates": comparison.sides[name].rates, "reps": comparison.sides[name].reps,
                        "cpu_shares": comparison.sides[name].cpu_shares} for name in (a, b)}
        if comparison.profiled and ({a, b} & set(comparison.profiled.split(", "))):
            note = f"{note}; PROFILED ({comparison.profiled}): not a valid measurement".lstrip("; ")
        self.target(key, comparison.ratio(a, b), comparison.load(), note, sides)


def info(results: Results, group: str, cmp: Comparison, a: str, b: str, name: str) -> None:
    """A ratio row without a target (same interleaved measurement as the targets beside it)."""
    results.row(group, f"ratio {name}", cmp.ratio(a, b), "x", "interleaved, from best rounds", cmp.load())


def verdict(value: float, op: str, required: float) -> bool:
    return value >= required if op == ">=" else value <= required
