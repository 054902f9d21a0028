"""Damage for the fuzzer: seeded choices of what to do to which file of a cache, and doing it.

A ``Damage`` is one concrete change of one file, named so that a failure message reproduces it by hand: truncate
to a size, extend by some bytes (real bytes, never a hole: a sparse file is what the fuzzer catches the library
making), write bytes at an offset, or set one value of ``meta.json`` (a JSON path and the new value). ``choose``
draws it from the case's seed, knowing the file's structure (``Context``: ``.npy`` header sizes, index rows, heap
counters, free extents), so that most damage is plausible (a word of an index row set to the heap's end, a
free-list head set past the heap, a key set to another index) rather than noise the first check rejects.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Any

import numpy as np

from mmapcache.store import heap as _heap

# Values written into int64 words: boundaries, sign and width edges. Context-relative ones are added per file.
INT64_EDGES = (0, 1, -1, -8, 2**31 - 1, 2**31, 2**32, 2**30, 2**40, 2**62, 2**63 - 1, -(2**63), -(2**31))
UINT32_EDGES = (0, 1, 2, 3, 2**31, 2**32 - 1, 2**32 - 2)
# Structural damage every file gets: (what, how) and the new size or added bytes (None: chosen per file).
EXTENDS = (1, 4096, 1 << 20)
STATE_WORDS = {"keys.i64", "heaps.u64", "changes.u64", "ring.u64"}
EMPTY_FILES = {"lock", "users", "producers"}


@dataclasses.dataclass(frozen=True)
class Damage:
    """One change of one file of a cache (``op``: truncate, extend, write, meta)."""

    file: str
    op: str
    offset: int = 0  # truncate: the new size; extend: bytes added; write: where
    data: str = ""  # write: the bytes (hex); extend: the repeated byte (hex); meta: the new value (JSON)
    path: tuple[Any, ...] = ()  # meta: where in the document
    note: str = ""  # what the bytes mean

    def describe(self) -> str:
        if self.op == "truncate":
            text = f"truncate {self.file} to {self.offset} bytes"
        elif self.op == "extend":
            text = f"extend {self.file} by {self.offset} bytes of 0x{self.data}"
        elif self.op == "write":
            text = f"write {self.data} at offset {self.offset} of {self.file}"
        else:
            text = f"set meta.json {'/'.join(map(str, self.path))} = {self.data}"
        return text + (f" ({self.note})" if self.note else "")

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "path": list(self.path)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Damage:
        return cls(**{**obj, "path": tuple(obj["path"])})


def apply(cache: str, damage: Damage) -> None:
    """Does ``damage`` to the cache directory ``cache``, with plain file operations."""
    name = os.path.join(cache, damage.file)
    if damage.op == "truncate":
        os.truncate(name, damage.offset)
    elif damage.op == "extend":
        with open(name, "ab") as f:
            f.write(bytes.fromhex(damage.data) * damage.offset)
    elif damage.op == "write":
        with open(name, "r+b") as f:
            f.seek(damage.offset)
            f.write(bytes.fromhex(damage.data))
    elif damage.op == "meta":
        with open(name) as f:
            meta = json.load(f)
        node = meta
        for key in damage.path[:-1]:
            node = node[key]
        node[damage.path[-1]] = json.loads(damage.data)
        with open(name, "w") as f:
            json.dump(meta, f, indent=1)
    else:
        raise ValueError(f"unknown damage {damage.op!r}")


# --- what a pristine cache holds ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """The structure of a pristine cache that damage is aimed at."""

    path: str
    meta: dict[str, Any]
    sizes: dict[str, int]
    npy_offsets: dict[str, int]  # where each .npy file's data starts
    heaps: dict[str, tuple[int, np.ndarray]]  # heap file -> (its block number in heaps.u64, the block)
    index_of_heap: dict[str, str]  # heap file -> index file
    filled_rows: np.ndarray

    @classmethod
    def of(cls, path: str) -> Context:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        sizes = {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))}
        offsets = {}
        for name in sizes:
            if name.endswith(".npy"):
                with open(os.path.join(path, name), "rb") as f:
                    if np.lib.format.read_magic(f) == (1, 0):
                        np.lib.format.read_array_header_1_0(f)
                    else:
                        np.lib.format.read_array_header_2_0(f)
                    offsets[name] = f.tell()
        counters = np.fromfile(os.path.join(path, "heaps.u64"), "<u8").reshape(-1, _heap.BLOCK)
        heaps, index_of_heap = {}, {}
        for number, field in enumerate(f for f in meta["fields"] if f["heap"]):
            heaps[field["heap"]] = (number, counters[number])
            index_of_heap[field["heap"]] = field["index_file"]
        bits = np.fromfile(os.path.join(path, "filled.bits"), np.uint8)
        filled = np.flatnonzero(np.unpackbits(bits, bitorder="little", count=meta["rows"]))
        return cls(path, meta, sizes, offsets, heaps, index_of_heap, filled)

    def other_keys(self, row: int) -> list[int]:
        """The source indices a rotating share's ``row`` holds in generations 0..3 (empty for other caches)."""
        share = self.meta["share"]
        if not share or share["rotate_every"] is None:
            return []
        from mmapcache.store.share import Share

        shares = [Share.from_json(share).indices(self.meta["length"], g) for g in range(4)]
        slot = row // self.meta["variants"]
        return [int(s[slot]) for s in shares if slot < len(s)]

    def free_extents(self, heap: str) -> list[int]:
        """Offsets of the free extents on the heap's lists (walked in the pristine file)."""
        _, block = self.heaps[heap]
        data = np.fromfile(os.path.join(self.path, heap), np.uint8)
        out = []
        for head in block[_heap.HEADS:].tolist():
            at = head
            while at and len(out) < 64:
                out.append(at - 1)
                at = int(data[at - 1:at + 7].view("<u8")[0])
        return out


# --- choosing damage ---------------------------------------------------------------------------------------------


def files_of(ctx: Context) -> list[str]:
    """The files of a cache that damage may hit, each listed as often as it deserves attention."""
    weighted = []
    for name in ctx.sizes:
        if name in EMPTY_FILES:
            weight = 1
        elif name == "meta.json" or name.endswith((".heap", ".index.npy")) or name in STATE_WORDS:
            weight = 6
        else:
            weight = 3
        weighted += [name] * weight
    return weighted


def choose(ctx: Context, rng: random.Random, sweep: int = -1) -> Damage:
    """A damage of one file: in round ``sweep`` of a sweep, the ``sweep``-th of the cache's files (in name order),
    so that the first rounds of a run hit every file; past them (and by default) one drawn by ``files_of``'s
    weights."""
    names = sorted(ctx.sizes)
    name = names[sweep] if 0 <= sweep < len(names) else rng.choice(files_of(ctx))
    size = ctx.sizes[name]
    if name in EMPTY_FILES or rng.random() < 0.2:
        return _structural(name, size, rng)
    if name == "meta.json":
        return _meta(ctx, rng)
    if name.endswith(".heap"):
        return _heap_damage(ctx, name, rng)
    if name in ("filled.bits", "stale.bits"):
        return _bits(ctx, name, rng)
    if name == "seq.u32":
        row = _a_row(ctx, rng)
        value = rng.choice(UINT32_EDGES)
        return Damage(name, "write", 4 * row, np.array([value], "<u4").tobytes().hex(), note=f"seq[{row}] = {value}")
    if name in STATE_WORDS or name.endswith((".index.npy", ".shape.npy")) or name == "slot_index.npy":
        return _word(ctx, name, rng)
    return _bytes(ctx, name, rng)  # fixed rows: their header or their values


def _structural(name: str, size: int, rng: random.Random) -> Damage:
    how = rng.choice(["zero", "random", "one less", "extend"] if size else ["extend"])
    if how == "zero":
        return Damage(name, "truncate", 0)
    if how == "random":
        return Damage(name, "truncate", rng.randrange(size))
    if how == "one less":
        return Damage(name, "truncate", size - 1)
    return Damage(name, "extend", rng.choice(EXTENDS), f"{rng.choice([0, 0xFF, rng.randrange(256)]):02x}")


def _a_row(ctx: Context, rng: random.Random) -> int:
    """Mostly a filled row (damage there is read), sometimes any row."""
    rows = ctx.meta["rows"]
    if len(ctx.filled_rows) and rng.random() < 0.8:
        return int(rng.choice(ctx.filled_rows.tolist()))
    return rng.randrange(max(rows, 1))


def _int64(value: int) -> str:
    return np.array([value], "<i8").tobytes().hex() if value < 2**63 else np.array([value], "<u8").tobytes().hex()


def _word(ctx: Context, name: str, rng: random.Random) -> Damage:
    """An int64 word of an index, shape file, slot index, keys, heap counters, cache counter or ring."""
    start = ctx.npy_offsets.get(name, 0)
    words = (ctx.sizes[name] - start) // 8
    if words <= 0:
        return _structural(name, ctx.sizes[name], rng)
    data = np.fromfile(os.path.join(ctx.path, name), np.uint8)[start:start + 8 * words].view("<i8")
    heap_sizes = [ctx.sizes[h] for h in ctx.heaps] or [0]
    ends = [int(block[_heap.END]) for _, block in ctx.heaps.values()] or [0]
    width = 1
    if name.endswith(".index.npy"):
        width = 2 + len(next(f for f in ctx.meta["fields"] if f["index_file"] == name)["shape"])
    elif name.endswith(".shape.npy"):
        width = words // max(ctx.meta["rows"], 1)
    if name in ("keys.i64", "seq.u32") or width > 1 or name.endswith(".shape.npy"):
        row = _a_row(ctx, rng)
        k = min(row * width + rng.randrange(width), words - 1)
    elif name == "heaps.u64":
        block = rng.randrange(max(1, words // _heap.BLOCK))
        heads = [i for i in range(_heap.HEADS, _heap.BLOCK) if data[block * _heap.BLOCK + i]]
        k = block * _heap.BLOCK + rng.choice([*range(5), *heads, *heads, rng.randrange(_heap.HEADS, _heap.BLOCK)])
    elif name == "ring.u64":
        k = rng.choice([0, 1, 2, 3, 4, 5, 8, 9, 9, 8, 10, 11])
    else:
        k = rng.randrange(words)
    current = int(data[k])
    if width > 1 and rng.random() < 0.25:  # another row's whole index row: two rows on one extent
        other = _a_row(ctx, rng)
        row = k // width
        values = data[other * width:(other + 1) * width]
        return Damage(name, "write", start + 8 * row * width, values.tobytes().hex(),
                      note=f"row {row} = row {other}: {values.tolist()}")
    pool = [*INT64_EDGES, current + 1, current - 1, current + 8, current * 2, *heap_sizes, *ends,
            *(s + 1 for s in heap_sizes), *(e + 8 for e in ends), int(data[rng.randrange(words)])]
    rows = ctx.meta["rows"]
    pool += [rows, rows - 1, rows + 1]  # changes.u64's count of complete rows: "every row is complete"
    if name == "keys.i64" or name == "slot_index.npy":
        pool += [ctx.meta["length"], ctx.meta["length"] - 1, rng.randrange(max(ctx.meta["length"], 1))] * 3
    if name == "keys.i64":
        # Keys that other rows' values legitimately carry: the same slot's index in another generation of a
        # rotating share, the sequence number a lap before or after in a stream.
        pool += [current + rows, current - rows, *ctx.other_keys(k)] * 3
    value = rng.choice(pool)
    value = max(-(2**63), min(value, 2**64 - 1))
    return Damage(name, "write", start + 8 * k, _int64(value), note=f"word {k} (row {k // width}, column "
                  f"{k % width}) {current} -> {value}")


def _bits(ctx: Context, name: str, rng: random.Random) -> Damage:
    size = ctx.sizes[name]
    offset = rng.randrange(size) if size else 0
    old = np.fromfile(os.path.join(ctx.path, name), np.uint8)
    how = rng.choice(["flip", "flip", "ff", "00"])
    if how == "flip":
        bit = rng.randrange(8)
        value = int(old[offset]) ^ (1 << bit)
        return Damage(name, "write", offset, f"{value:02x}", note=f"flip row {8 * offset + bit}")
    return Damage(name, "write", offset, how, note=f"rows {8 * offset}..{8 * offset + 7}")


def _bytes(ctx: Context, name: str, rng: random.Random) -> Damage:
    size = ctx.sizes[name]
    start = ctx.npy_offsets.get(name, 0)
    if rng.random() < 0.4:  # the header: its magic, its dict, its padding
        offset, length = rng.randrange(start or 1), rng.randrange(1, 4)
    else:
        offset = rng.randrange(start, max(size, start + 1))
        length = rng.randrange(1, 17)
    return _random_bytes(name, offset, length, rng)


def _random_bytes(name: str, offset: int, length: int, rng: random.Random, note: str = "") -> Damage:
    fill = rng.choice(["random", "00", "ff"])
    data = bytes(rng.randrange(256) for _ in range(length)) if fill == "random" else bytes.fromhex(fill) * length
    return Damage(name, "write", offset, data.hex(), note=note)


def _heap_damage(ctx: Context, name: str, rng: random.Random) -> Damage:
    _, block = ctx.heaps[name]
    end, capacity = int(block[_heap.END]), int(block[_heap.CAPACITY])
    free = ctx.free_extents(name)
    how = rng.choice(["value", "value", "free", "free", "past"] if free else ["value", "value", "past"])
    if how == "value":  # the bytes of values (verify with the source sees them differ)
        return _random_bytes(name, rng.randrange(max(end, 1)), rng.randrange(1, 9), rng, note="in the used part")
    if how == "past":  # between the end and the capacity (no row uses it)
        offset = rng.randrange(end, capacity) if capacity > end else end
        return _random_bytes(name, offset, rng.randrange(1, 17), rng, note="past the used end")
    extent = rng.choice(free)
    word = rng.randrange(2)
    pool = [*INT64_EDGES, end, end + 1, capacity, capacity + 1, capacity + 16, extent + 1, rng.choice(free) + 1]
    value = rng.choice(pool)
    what = "next (1 + offset)" if word == 0 else "size"
    return Damage(name, "write", extent + 8 * word, _int64(value),
                  note=f"free extent at {extent}: its {what} = {value}")


# --- meta.json ---------------------------------------------------------------------------------------------------

_DTYPES = ["<i8", "<f8", "|u1", "<u2", ">i8", "<i4", "|b1", "<f4", "<c16"]
_KINDS = ["tensor", "ndarray", "int", "float", "bool", "numpy_scalar", "str", "bytes", "pylist", "json"]


def _meta(ctx: Context, rng: random.Random) -> Damage:
    text_size = ctx.sizes["meta.json"]
    if rng.random() < 0.25:
        offset = rng.randrange(text_size)
        return _random_bytes("meta.json", offset, rng.randrange(1, 3), rng, note="byte flip")
    meta = ctx.meta
    fields = meta["fields"]
    n = rng.randrange(len(fields))
    field = fields[n]
    other = fields[rng.randrange(len(fields))]
    choices: list[tuple[tuple[Any, ...], Any]] = []
    for key in ("length", "slots", "variants", "rows"):
        v = meta[key]
        choices += [((key,), v + 1), ((key,), v - 1), ((key,), 0), ((key,), 2**63), ((key,), v * 2)]
    choices += [(("heap_budget",), rng.choice([0, 1, 4096, -1, 2**63])), (("fingerprint",), "another"),
                (("fingerprint",), None), (("slot_index",), None), (("slot_index",), "slot_index.npy"),
                (("mode",), "stream" if meta["mode"] == "cache" else "cache")]
    if meta["share"]:
        choices += [(("share", k), v) for k in ("node", "nodes", "seed", "rotate_every") for v in (0, 2, 7, None)]
    if meta["stream"]:
        choices += [(("stream", "seed"), 4), (("stream",), None)]
    shape = list(field["shape"])
    choices += [(("fields", n, "shape"), shape[:-1]), (("fields", n, "shape"), [*shape, 1])]
    if shape:
        d = rng.randrange(len(shape))
        for v in (shape[d] + 1, shape[d] - 1, 0, -1):
            choices.append((("fields", n, "shape"), [*shape[:d], v, *shape[d + 1:]]))
    choices += [(("fields", n, "dtype"), rng.choice(_DTYPES)), (("fields", n, "kind"), rng.choice(_KINDS)),
                (("fields", n, "name"), other["name"]), (("fields", n, "ragged"), not field["ragged"]),
                (("fields", n, "variable"), not field["variable"]),
                (("fields", n, "torch_dtype"), rng.choice([None, "int64", "float32", "uint8", "bfloat16"]))]
    for key in ("file", "heap", "index_file", "shape_file"):
        choices += [(("fields", n, key), other[key]), (("fields", n, key), None),
                    (("fields", n, key), rng.choice(sorted(ctx.sizes)))]
    leaves = _leaf_paths(meta["structure"], ("structure",))
    if len(leaves) > 1:
        a, b = rng.sample(leaves, 2)
        choices += [(a, _get(meta, b)), (a, {"leaf": len(fields)})]
    path, value = rng.choice(choices)
    return Damage("meta.json", "meta", data=json.dumps(value), path=path)


def _leaf_paths(node: Any, at: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    if isinstance(node, dict):
        if "leaf" in node:
            return [at]
        return [p for k, v in node.items() for p in _leaf_paths(v, (*at, k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _leaf_paths(v, (*at, i))]
    return []


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc
