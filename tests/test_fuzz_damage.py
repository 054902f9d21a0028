"""A seeded damage fuzzer, in the spirit of SQLite's fault injection: damage one file of a small cache in one way,
then open, read, batch, write, verify and inspect it in a child process, and hold every outcome to the oracle of
``helpers.fuzz_oracle`` (a correct sample, ``CacheFormatError``, or damage that verify reports; never a silent wrong
sample, another exception, a hang, a signal, a file grown or made sparse, a write outside the cache, or a CLI
verify exiting 0 or 2 on damage).

Cache kinds (``helpers.fuzz_caches``): fixed fields; ragged fields with free lists; a partial cache with a slot
index and a ``max_shapes`` field; two variants; a stream with cursors; a rotating node share. Damage
(``helpers.fuzz_damage``): truncation, extension, random and boundary bytes and words in every file, valid-JSON
edits of ``meta.json``.

Environment (every failure message prints the command that reproduces its first case):

- ``MMAPCACHE_FUZZ_SEED``: the seed (default: a fixed one, so CI is repeatable);
- ``MMAPCACHE_FUZZ_CASES``: how many cases (default: one sweep, every file of every kind damaged once, 96 cases
  in ~15 s on 2 cores; the same cases on every run), ``MMAPCACHE_FUZZ_SECONDS``: a time limit for them
  (default 600). The long run, a budget of time: ``MMAPCACHE_FUZZ_CASES=1000000 MMAPCACHE_FUZZ_SECONDS=420``;
- ``MMAPCACHE_FUZZ_ONLY``: run only these cases (``57`` or ``57,60``), e.g. to reproduce one;
- ``MMAPCACHE_FUZZ_KINDS``: the kinds, comma-separated (default: all);
- ``MMAPCACHE_FUZZ_STEP_TIMEOUT``: seconds one step may take before it counts as a hang (default 20);
- ``MMAPCACHE_FUZZ_CLI_EVERY``: run ``python -m mmapcache verify`` in a subprocess every this many cases
  (default 5, prime to the 6 kinds so every kind gets it: an interpreter per case took two thirds of the sweep's
  time; 1: every case; 0: never; the in-process ``cli.main`` runs in every case regardless);
- ``MMAPCACHE_FUZZ_REPORT``: a path to write the findings to as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from helpers.fuzz_caches import KINDS, build_all
from helpers.fuzz_driver import report, run_cases
from mmapcache import verify

SEED = int(os.environ.get("MMAPCACHE_FUZZ_SEED", "20261125"))
SECONDS = float(os.environ.get("MMAPCACHE_FUZZ_SECONDS", "600"))
CASES = int(os.environ.get("MMAPCACHE_FUZZ_CASES", "0"))  # 0: one sweep (see the module docstring)
ONLY = os.environ.get("MMAPCACHE_FUZZ_ONLY", "")
FUZZ_KINDS = [k for k in os.environ.get("MMAPCACHE_FUZZ_KINDS", ",".join(KINDS)).split(",") if k]
STEP_TIMEOUT = float(os.environ.get("MMAPCACHE_FUZZ_STEP_TIMEOUT", "20"))
CLI_EVERY = int(os.environ.get("MMAPCACHE_FUZZ_CLI_EVERY", "5"))
COMMAND = "python3 -m pytest tests/test_fuzz_damage.py::test_damage_fuzz"


def _digest(directory: str) -> dict[str, str]:
    out = {}
    for base, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(base, name), "rb") as f:
                out[os.path.join(base, name)] = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_verify_of_an_intact_cache_of_every_kind_is_ok(shm_dir: str, kind: str) -> None:
    # The fuzzer's oracle leans on verify: on an intact cache, with its own source, it must report nothing.
    KINDS[kind].build(os.path.join(shm_dir, "cache"))
    result = verify(os.path.join(shm_dir, "cache"), KINDS[kind].source(), samples=None)
    assert result.ok, f"{kind}: {result.problems + result.differences}"


def test_damage_fuzz(shm_dir: str) -> None:
    unknown = set(FUZZ_KINDS) - set(KINDS)
    assert not unknown, f"MMAPCACHE_FUZZ_KINDS names unknown kinds {sorted(unknown)}; known: {sorted(KINDS)}"
    pristine = os.path.join(shm_dir, "pristine")
    build_all(pristine, FUZZ_KINDS)
    before = _digest(pristine)
    # One sweep: every file of every kind in turn (make_case), as many rounds as the kind with the most files.
    sweep = len(FUZZ_KINDS) * max(len(os.listdir(os.path.join(pristine, kind, "cache"))) for kind in FUZZ_KINDS)
    cases = [int(n) for n in ONLY.split(",")] if ONLY else list(range(CASES or sweep))
    run = run_cases(shm_dir, SEED, FUZZ_KINDS, cases, seconds=SECONDS if not ONLY else 600,
                    step_timeout=STEP_TIMEOUT, cli_every=CLI_EVERY)
    print(f"damage fuzzer: seed {SEED}, {len(run.finished)} cases in {run.seconds:.1f} s, "
          f"{len(run.findings)} distinct findings")
    if not ONLY and not CASES:
        assert len(run.finished) == sweep, f"the sweep ran {len(run.finished)} of its {sweep} cases in {SECONDS} s"
    if os.environ.get("MMAPCACHE_FUZZ_REPORT"):
        with open(os.environ["MMAPCACHE_FUZZ_REPORT"], "w") as f:
            json.dump({"seed": SEED, "cases": len(run.finished), "seconds": run.seconds,
                       "case_seconds": run.case_seconds,
                       "findings": [finding.to_json() for finding in run.findings.values()]}, f, indent=1)
    assert _digest(pristine) == before, "a damaged copy's steps changed the pristine caches beside it"
    assert run.finished, f"no case finished (seed {SEED}): {report(run, COMMAND)}"
    if run.findings:
        pytest.fail(report(run, COMMAND), pytrace=False)


def test_the_fuzzer_names_the_case_and_step_of_a_hang_and_a_signal_and_goes_on(
        shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The harness itself: a child that hangs is killed, one that dies of a signal is replaced, and every other case
    # still runs (fuzz_child's MMAPCACHE_FUZZ_SELFTEST hook hangs or kills the child while it opens a case's cache).
    monkeypatch.setenv("MMAPCACHE_FUZZ_SELFTEST", "hang:1,segv:3")
    build_all(os.path.join(shm_dir, "pristine"), ["fixed"])
    run = run_cases(shm_dir, SEED, ["fixed"], [0, 1, 2, 3, 4], seconds=120, step_timeout=5, cli_every=0)
    assert sorted(run.finished) == [0, 1, 2, 3, 4] and run.children == 3
    by_oracle = {finding.oracle: finding for finding in run.findings.values()}
    hang = by_oracle["a step hung (no report within the step timeout; killed)"]
    signal = by_oracle["the process died of a signal (SIGSEGV)"]
    assert hang.cases == [1] and hang.first["step"] == "open with the source"
    assert signal.cases == [3] and signal.first["step"] == "open with the source"
