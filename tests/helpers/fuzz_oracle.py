"""The damage fuzzer's oracle: which outcomes of a step on a damaged cache are allowed, and which are findings.

Allowed: a correct sample (equal to the source's), ``CacheFormatError`` (``CacheMismatchError`` too: for a
``meta.json`` that describes another valid cache, or for a damaged stored sample that an opener compared with its
source, which verify must then report; ``SampleNotCachedError`` without a source), or a wrong sample
that ``verify(path, source, samples=None)`` reports. Findings, each recorded once per case under a signature
(oracle, exception class, innermost library frame, file role) that the test deduplicates on:

- a wrong sample served while verify, run on the same damaged state, reports nothing it does not report of the
  intact cache (a silent wrong answer);
- any other exception: a private one (``NoRoom``, ``Torn``...), a raw builtin (``ValueError``, ``OSError``...), a
  foreign one (numpy, torch), or another mmapcache error;
- the library detecting damage (``CacheFormatError``) that verify calls ok;
- ``mmapcache verify`` exiting 0 on damage verify sees, or 2 (a usage error or crash) on damage: damage is exit 1;
- files growing, shrinking or becoming sparse, files beside the cache written, read-only steps writing (the case
  runner, ``fuzz_child``, checks those and adds them here).
"""

from __future__ import annotations

import errno
import os
import traceback
from typing import Any

import numpy as np
import torch

import mmapcache
from helpers.fuzz_damage import Damage

_PACKAGE = os.path.dirname(os.path.abspath(mmapcache.__file__)) + os.sep
_VERIFY_STEPS = ("verify", "cli", "describe")


def clean(result: Any, path: str) -> list[str]:
    """What a ``VerifyResult`` reports, with the cache's path left out (so two copies' reports compare)."""
    found = [*result.problems, *result.differences, *([result.mismatch] if result.mismatch else [])]
    return [text.replace(path, "<cache>") for text in found]


def role(name: str) -> str:
    """A file's role (``tokens.index.npy`` and ``caption.index.npy`` are one role)."""
    for suffix in (".index.npy", ".shape.npy", ".heap"):
        if name.endswith(suffix):
            return "<field>" + suffix
    if name.endswith(".npy") and name != "slot_index.npy":
        return "<field>.npy"
    return name


def library_frame(exc: BaseException) -> str | None:
    """``module.py:function`` of the innermost frame inside mmapcache, or None."""
    frame = None
    for entry in traceback.extract_tb(exc.__traceback__):
        if entry.filename.startswith(_PACKAGE):
            frame = f"{entry.filename[len(_PACKAGE):]}:{entry.name}"
    return frame


def _short(filename: str) -> str:
    return filename[len(_PACKAGE) - len("mmapcache/"):] if filename.startswith(_PACKAGE) else os.path.basename(filename)


class Verdicts:
    """The findings of one case."""

    def __init__(self, kind: str, damage: Damage, baseline: list[str]) -> None:
        self.kind, self.damage, self.baseline = kind, damage, baseline
        self.role = role(damage.file)
        self.found: dict[tuple[str, str | None, str | None, str], dict[str, Any]] = {}
        self.detected: list[str] = []  # CacheFormatErrors the library raised outside verify
        self.wrongs: dict[str, list[str]] = {"before": [], "after": []}
        self.verify: dict[str, str] = {}  # when -> "ok", "found" or "raised"
        self.plain = "raised"  # verify(path) without a source: "ok", "found" or "raised"

    def add(self, oracle: str, step: str, exception: str | None, frame: str | None, detail: str,
            group: str = "") -> None:
        key = (oracle, exception, frame, group)
        if key in self.found:
            self.found[key]["count"] += 1
            return
        self.found[key] = {"oracle": oracle, "step": step, "exception": exception, "frame": frame,
                           "group": group, "role": self.role, "detail": detail[:1500], "count": 1}

    def violations(self) -> list[dict[str, Any]]:
        return list(self.found.values())

    # --- what each step did ------------------------------------------------------------------------------------

    def accepted(self, step: str, exc: BaseException) -> None:
        # A meta.json or slot_index.npy changed into another valid cache's is another cache to an opener that asks
        # for this one (its options), which verify, knowing no options, cannot call damage.
        describes = self.damage.file in ("meta.json", "slot_index.npy")
        detects = (mmapcache.CacheFormatError,) if describes else (mmapcache.CacheFormatError,
                                                                     mmapcache.CacheMismatchError)
        if not step.startswith(_VERIFY_STEPS) and isinstance(exc, detects):
            self.detected.append(f"{step}: {type(exc).__name__}: {str(exc)[:300]}")

    def exception(self, step: str, exc: BaseException) -> None:
        cls = type(exc)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if isinstance(exc, OSError) and exc.errno is not None:
            name += f"[{errno.errorcode.get(exc.errno, exc.errno)}]"
        if cls.__module__.startswith("mmapcache"):
            exported = cls.__name__ in mmapcache.__all__
            oracle = "an unexpected mmapcache error" if exported else "a private exception escaped the library"
        elif cls.__module__ == "builtins":
            oracle = "a raw builtin exception from the library"
        else:
            oracle = "a foreign exception from the library"
        frames = [f"{_short(e.filename)}:{e.lineno} {e.name}: {e.line}"
                  for e in traceback.extract_tb(exc.__traceback__)]
        self.add(oracle, step, name, library_frame(exc), f"{name}: {str(exc)[:300]}\n" + "\n".join(frames[-4:]))

    def wrong(self, when: str, step: str, what: str) -> None:
        self.wrongs[when].append(f"{step}: {what}")

    def harness(self, step: str, detail: str) -> None:
        self.add("fuzzer harness error", step, None, None, detail)

    def verified(self, when: str, result: Any, plain: Any, path: str) -> None:
        """Records what verify said of the damaged cache: with the source (``result``) and without (``plain``);
        None where it raised (an accepted CacheFormatError, or a finding already recorded)."""
        if result is None:
            self.verify[when] = "raised"
        else:
            extra = [p for p in clean(result, path) if p not in self.baseline]
            self.verify[when] = "found" if extra else "ok"
        if when == "before":
            self.plain = "raised" if plain is None else "found" if plain.problems or plain.mismatch else "ok"

    def cli(self, step: str, code: int | str) -> None:
        if code == 2:
            self.add("the CLI verify exits 2 (usage error) on damage; damage is exit 1", step, None, None,
                     f"verify() without a source: {self.plain}")
        elif code == 0 and self.plain != "ok":
            self.add("the CLI verify exits 0 on damage verify() sees", step, None, None,
                     f"verify() without a source: {self.plain}", group=self.role)
        elif code == 1 and self.plain == "ok":
            self.add("the CLI verify exits 1 where verify() reports ok", step, None, None, "", group=self.role)
        elif code == "timed out":
            self.add("the CLI verify hung", step, None, None, "", group=self.role)

    def judge(self) -> None:
        for when, wrongs in self.wrongs.items():
            if wrongs and self.verify.get(when) == "ok":
                self.add("a wrong sample served while verify(path, source, samples=None) reports the cache ok",
                         wrongs[0].split(":")[0], None, None,
                         f"{len(wrongs)} wrong: {'; '.join(wrongs[:4])}", group=self.role)
        if self.detected and self.verify.get("before") == "ok":
            self.add("the library raised CacheFormatError (or CacheMismatchError) on damage verify() reports ok",
                     self.detected[0][:60],
                     None, None, self.detected[0], group=self.role)


# --- comparing collated batches ----------------------------------------------------------------------------------


def _array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.contiguous().numpy() if value.dtype != torch.bfloat16 else value.view(torch.int16).numpy()
    return np.asarray(value)


def _same(got: Any, expected: Any) -> bool:
    a, b = _array(got), _array(expected)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def batch_equal(batch: Any, samples: list[Any]) -> bool:
    """Whether ``batch`` is what ``default_collate`` makes of ``samples`` (a field whose shape varies in the batch:
    a list of its values, as ``ds.loader`` makes it); compared by dtype, shape and bytes."""
    if not samples:
        return False
    first = samples[0]
    if isinstance(first, dict):
        return isinstance(batch, dict) and list(batch) == list(first) and all(
            batch_equal(batch[k], [s[k] for s in samples]) for k in first)
    if isinstance(first, (tuple, list)):
        return isinstance(batch, (tuple, list)) and len(batch) == len(first) and all(
            batch_equal(b, list(column)) for b, column in zip(batch, zip(*samples)))
    if isinstance(first, (str, bytes)):
        return isinstance(batch, (list, tuple)) and list(batch) == samples
    arrays = [_array(s) for s in samples]
    if isinstance(batch, (list, tuple)):
        return len(batch) == len(samples) and all(_same(g, e) for g, e in zip(batch, arrays))
    if len({(a.shape, a.dtype) for a in arrays}) != 1:
        return False
    return _same(batch, np.stack(arrays))
