"""The on-disk format checked without the library: a process that imports only numpy and json reads the cache,
and every ``meta.json`` field is checked against the raw bytes of the files it describes."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import torch

import mmapcache
from helpers.sources import sample_equal
from mmapcache import MmapCachedDataset

N = 10
FILLED = [0, 1, 2, 4, 5, 6, 9]

# Runs in a fresh interpreter: it must read the cache with numpy alone (no torch, no mmapcache).
NUMPY_ONLY_READER = r"""
import json, os, sys
import numpy as np
path, out = sys.argv[1], sys.argv[2]
with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
    meta = json.load(f)
arrays = {}
for field in meta["fields"]:
    data = np.load(os.path.join(path, field["file"]), mmap_mode="r")
    arrays["field:" + field["name"]] = np.array(data)
arrays["filled"] = np.unpackbits(np.fromfile(os.path.join(path, "filled.bits"), np.uint8), bitorder="little")
arrays["stale"] = np.unpackbits(np.fromfile(os.path.join(path, "stale.bits"), np.uint8), bitorder="little")
arrays["seq"] = np.fromfile(os.path.join(path, "seq.u32"), "<u4")
np.savez(out, **arrays)
print(json.dumps({"torch": "torch" in sys.modules, "mmapcache": "mmapcache" in sys.modules}))
"""


class Mixed:
    """A map-style source with a tensor, a numpy-less dtype, an ndarray, and Python scalars."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> Any:
        g = torch.Generator().manual_seed(index)
        return {
            "image": torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g),
            "weights": torch.randn(4, generator=g).to(torch.bfloat16),
            "arr": np.arange(2, dtype=np.float32) + index,
            "label": index * 7 % 10,
            "flag": index % 2 == 0,
        }


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _make(cache_path: str) -> MmapCachedDataset:
    source = Mixed()
    ds = MmapCachedDataset(cache_path, source, fingerprint="fmt-test", ragged=None)  # exactly FILLED stored
    for i in FILLED:
        ds[i]
    return ds


def test_numpy_alone_reads_the_cache(cache_path: str, tmp_path: Any) -> None:
    source = Mixed()
    with _make(cache_path) as ds:
        hits = {i: ds[i] for i in FILLED}
    out = str(tmp_path / "read.npz")
    result = subprocess.run([sys.executable, "-c", NUMPY_ONLY_READER, cache_path, out], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"torch": False, "mmapcache": False}
    got = np.load(out)
    filled = got["filled"]
    assert len(filled) == 8 * math.ceil(N / 8)
    assert filled[:N].tolist() == [int(i in FILLED) for i in range(N)] and not filled[N:].any()
    assert not got["stale"].any()
    seq = got["seq"]
    assert seq.shape == (N,) and all(seq[i] >= 2 and seq[i] % 2 == 0 for i in FILLED)
    assert all(seq[i] == 0 for i in range(N) if i not in FILLED)
    for i in FILLED:
        expected = source[i]
        assert np.array_equal(got["field:image"][i], expected["image"].numpy())
        assert got["field:weights"][i].tobytes() == expected["weights"].view(torch.uint16).numpy().tobytes()
        assert got["field:arr"][i].tobytes() == expected["arr"].tobytes()
        assert int(got["field:label"][i]) == expected["label"] and bool(got["field:flag"][i]) is expected["flag"]
        assert sample_equal(hits[i], expected)
    for i in set(range(N)) - set(FILLED):  # never written rows are zero (the files were reserved, not dirtied)
        assert not got["field:image"][i].any()


def test_meta_json_matches_the_raw_bytes(cache_path: str) -> None:
    _make(cache_path).close()
    with open(os.path.join(cache_path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["magic"] == "mmapcache" and meta["format_version"] == 2
    assert meta["library_version"] == mmapcache.__version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["created"])
    assert (meta["length"], meta["slots"], meta["variants"], meta["rows"]) == (N, N, 1, N)
    assert meta["slot_index"] is None and meta["fingerprint"] == "fmt-test" and meta["delete_on_close"] is False
    assert meta["structure"] == {"dict": [["image", {"leaf": 0}], ["weights", {"leaf": 1}], ["arr", {"leaf": 2}],
                                          ["label", {"leaf": 3}], ["flag", {"leaf": 4}]]}
    fields = {f["name"]: f for f in meta["fields"]}
    assert list(fields) == ["image", "weights", "arr", "label", "flag"]
    expected = {
        "image": ("tensor", "|u1", "uint8", [3, 8, 8]),
        "weights": ("tensor", "<u2", "bfloat16", [4]),  # no numpy bfloat16: stored as same-width uint
        "arr": ("ndarray", "<f4", None, [2]),
        "label": ("int", "<i8", None, []),
        "flag": ("bool", "|b1", None, []),
    }
    for name, (kind, dtype, torch_dtype, shape) in expected.items():
        field = fields[name]
        found = (field["kind"], field["dtype"], field["torch_dtype"], field["shape"])
        assert found == (kind, dtype, torch_dtype, shape)
        assert field["variable"] is False and field["shape_file"] is None and field["file"] == f"{name}.npy"
        raw = _bytes(os.path.join(cache_path, field["file"]))
        assert raw[:8] == b"\x93NUMPY\x01\x00"  # .npy format 1.0, as the format document says
        header_len = int.from_bytes(raw[8:10], "little")
        header = raw[10:10 + header_len].decode("latin1")
        offset = 10 + header_len
        assert offset % 64 == 0
        assert f"'descr': '{dtype}'" in header and "'fortran_order': False" in header
        assert f"'shape': {(N, *shape)}" in header
        itemsize = np.dtype(dtype).itemsize
        assert len(raw) == offset + N * itemsize * math.prod(shape)
    label_raw = _bytes(os.path.join(cache_path, "label.npy"))
    offset = len(label_raw) - 8 * N
    assert [int.from_bytes(label_raw[offset + 8 * i: offset + 8 * i + 8], "little", signed=True)
            for i in FILLED] == [Mixed()[i]["label"] for i in FILLED]
    assert os.path.getsize(os.path.join(cache_path, "filled.bits")) == math.ceil(N / 8)
    assert os.path.getsize(os.path.join(cache_path, "stale.bits")) == math.ceil(N / 8)
    assert os.path.getsize(os.path.join(cache_path, "seq.u32")) == 4 * N
    assert os.path.getsize(os.path.join(cache_path, "lock")) == 0
    assert os.path.getsize(os.path.join(cache_path, "users")) == 0
    assert os.path.getsize(os.path.join(cache_path, "heaps.u64")) == 0  # no ragged field
    keys = _bytes(os.path.join(cache_path, "keys.i64"))
    assert [int.from_bytes(keys[8 * i: 8 * i + 8], "little", signed=True) for i in FILLED] == sorted(FILLED)
    bits = _bytes(os.path.join(cache_path, "filled.bits"))
    assert bits == bytes([sum(1 << b for b in range(8) if 8 * k + b in FILLED) for k in range(len(bits))])
    changes = _bytes(os.path.join(cache_path, "changes.u64"))
    counter, complete = (int.from_bytes(changes[8 * w: 8 * w + 8], "little") for w in range(2))
    assert counter % 2 == 0 and counter > 0 and complete == len(FILLED)  # no writer mid-change; complete rows
    assert sorted(os.listdir(cache_path)) == sorted(
        ["meta.json", "filled.bits", "stale.bits", "seq.u32", "keys.i64", "heaps.u64", "changes.u64", "lock", "users"]
        + [f"{n}.npy" for n in fields])


def test_slot_index_and_prefix_caches(shm_dir: str) -> None:
    """``cache_indices`` writes slot_index.npy: slot s holds source index slot_index[s], row s its data."""
    source = Mixed()
    path = os.path.join(shm_dir, "subset")
    with MmapCachedDataset(path, source, cache_indices=[7, 2, 5]) as ds:
        for i in range(N):
            assert sample_equal(ds[i], source[i])
        assert ds.num_cached == 3 and not ds.is_cached(0)
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["slot_index"] == "slot_index.npy" and (meta["slots"], meta["rows"], meta["length"]) == (3, 3, N)
    slot_index = np.load(os.path.join(path, "slot_index.npy"))
    assert slot_index.dtype == np.dtype("<i8") and slot_index.tolist() == [7, 2, 5]
    image = np.load(os.path.join(path, "image.npy"), mmap_mode="r")
    assert image.shape == (3, 3, 8, 8)
    for slot, index in enumerate(slot_index):
        assert np.array_equal(image[slot], source[int(index)]["image"].numpy())
