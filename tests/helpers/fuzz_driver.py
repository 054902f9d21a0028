"""The damage fuzzer's parent side: runs the cases in child processes that may hang or die, and sums up findings.

One long-lived child (``helpers.fuzz_child``) runs many cases in sequence, so torch is imported once, not per
case. It reports each case's start, each step and each case's end on a pipe. The parent waits for each report at
most ``step_timeout`` seconds: a child silent for longer is hung, and is killed (its whole process group: the
CLI it may be running too); a child that dies of a signal (SIGBUS, SIGSEGV) or exits early names its case and
step. Either way a new child goes on with the next case. Nothing outlives ``run_cases``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)


@dataclasses.dataclass
class Finding:
    """Every case whose violation has one signature (oracle, exception, library frame, group)."""

    oracle: str
    exception: str | None
    frame: str | None
    group: str
    cases: list[int] = dataclasses.field(default_factory=list)
    kinds: set[str] = dataclasses.field(default_factory=set)
    roles: set[str] = dataclasses.field(default_factory=set)
    first: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "kinds": sorted(self.kinds), "roles": sorted(self.roles)}


@dataclasses.dataclass
class Run:
    """What a fuzzing run did: cases finished, findings by signature, children started."""

    seed: int
    finished: list[int] = dataclasses.field(default_factory=list)
    findings: dict[tuple[Any, ...], Finding] = dataclasses.field(default_factory=dict)
    children: int = 0
    seconds: float = 0.0
    case_seconds: list[float] = dataclasses.field(default_factory=list)

    def record(self, case: dict[str, Any], violation: dict[str, Any]) -> None:
        key = (violation["oracle"], violation["exception"], violation["frame"], violation["group"])
        finding = self.findings.setdefault(key, Finding(*key))
        finding.cases.append(case["case"])
        finding.kinds.add(case["kind"])
        finding.roles.add(violation.get("role", ""))
        if not finding.first:
            finding.first = {**case, "step": violation["step"], "detail": violation["detail"]}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The worktree's mmapcache and helpers, never an installed copy.
    env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def run_cases(root: str, seed: int, kinds: list[str], cases: list[int], *, seconds: float, step_timeout: float,
              cli_every: int) -> Run:
    """Runs ``cases`` (in order, until ``seconds`` have passed) against the pristine caches under ``root``."""
    run = Run(seed)
    started = time.monotonic()
    deadline = time.time() + seconds
    todo = list(cases)
    while todo and time.time() < deadline:
        done_through = _one_child(run, root, seed, kinds, todo, deadline, step_timeout, cli_every)
        todo = todo[done_through:]
    run.seconds = time.monotonic() - started
    return run


def _one_child(run: Run, root: str, seed: int, kinds: list[str], todo: list[int], deadline: float,
               step_timeout: float, cli_every: int) -> int:
    """Starts a child on ``todo`` and follows it until it ends, hangs or dies; returns how many of ``todo`` are
    done (finished, or the one it hung or died on)."""
    spec = f"{todo[0]}:{todo[-1] + 1}" if todo == list(range(todo[0], todo[-1] + 1)) else ",".join(map(str, todo))
    read_fd, write_fd = os.pipe()
    log = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in the finally below, with the pipe
    command = [sys.executable, "-m", "helpers.fuzz_child", "--root", root, "--seed", str(seed), "--kinds",
               ",".join(kinds), "--cases", spec, "--deadline", str(deadline), "--cli-every", str(cli_every),
               "--fd", str(write_fd)]
    proc = subprocess.Popen(command, pass_fds=(write_fd,), stdout=log, stderr=subprocess.STDOUT, env=_env(),
                            cwd=REPO, start_new_session=True)
    run.children += 1
    os.close(write_fd)
    current: dict[str, Any] | None = None
    step = "starting the child"
    done = 0
    buffer = b""
    # The first report comes after the child imported torch and verified the pristine caches: give it longer.
    timeout = step_timeout + 60
    try:
        while True:
            ready, _, _ = select.select([read_fd], [], [], timeout)
            if not ready:
                _kill(proc)
                _fail(run, current, step, "a step hung (no report within the step timeout; killed)", "hang",
                      f"no report for {timeout:.0f} s")
                return done + 1 if current is not None else len(todo)
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                event = json.loads(line)
                timeout = step_timeout
                if event["event"] == "start":
                    current, step = {"case": event["case"], "kind": event["kind"], "damage": event["damage"]}, ""
                elif event["event"] == "step":
                    step = event["step"]
                elif event["event"] == "done" and current is not None:
                    for violation in event["violations"]:
                        run.record(current, violation)
                    run.finished.append(event["case"])
                    run.case_seconds.append(event["seconds"])
                    current = None
                    done += 1
                elif event["event"] == "end":
                    return len(todo)
        # The pipe closed before "end": the child died.
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill(proc)
            code = proc.wait()
        log.seek(0)
        tail = log.read().decode(errors="replace")[-3000:]
        if code < 0:
            name = signal.Signals(-code).name
            _fail(run, current, step, f"the process died of a signal ({name})", name, tail)
        else:
            _fail(run, current, step, "the fuzzer's child exited early", f"exit {code}", tail)
        return done + 1 if current is not None else len(todo)
    finally:
        _kill(proc)
        os.close(read_fd)
        log.close()


def _fail(run: Run, current: dict[str, Any] | None, step: str, oracle: str, group: str, detail: str) -> None:
    from helpers.fuzz_oracle import role

    case = current or {"case": -1, "kind": "?", "damage": {}}
    run.record(case, {"oracle": oracle, "exception": None, "frame": None, "group": group, "step": step,
                      "detail": detail, "role": role(case["damage"].get("file", ""))})
    if current is not None:
        run.finished.append(current["case"])


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kills the child and everything it started (its own session), and reaps it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # grandchildren of a child that exited on its own


def describe_damage(damage: dict[str, Any]) -> str:
    from helpers.fuzz_damage import Damage

    return Damage.from_json(damage).describe() if damage else "?"


def report(run: Run, command: str) -> str:
    """The failure message: each finding once, with its first case and the command that reproduces it."""
    lines = [f"damage fuzzer, seed {run.seed}: {len(run.findings)} distinct finding(s) in {len(run.finished)} "
             f"case(s) ({run.seconds:.0f} s, {run.children} child process(es))"]
    order = sorted(run.findings.values(), key=lambda f: (f.oracle, -len(f.cases)))
    for n, finding in enumerate(order, 1):
        first = finding.first
        what = " ".join(filter(None, [finding.exception, f"at {finding.frame}" if finding.frame else None,
                                      f"[{finding.group}]" if finding.group else None]))
        lines.append(f"\n{n}. {finding.oracle}: {what} -- {len(finding.cases)} case(s), kinds "
                     f"{', '.join(sorted(finding.kinds))}; files {', '.join(sorted(finding.roles))}")
        lines.append(f"   first: case {first['case']} ({first['kind']}): {describe_damage(first['damage'])}")
        lines.append(f"   step: {first['step']}")
        detail = first["detail"].strip().replace("\n", "\n      ")
        lines.append(f"   detail: {detail[:900]}")
        lines.append(f"   reproduce: MMAPCACHE_FUZZ_SEED={run.seed} MMAPCACHE_FUZZ_ONLY={first['case']} {command}")
    return "\n".join(lines)
