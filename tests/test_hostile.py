"""Findings of a hostile test: nothing outside a cache is ever written or removed, symlinked paths leave nothing
behind, long names get a clear error, a meta.json naming one file twice is damage, and verify tells a mismatched
source from damage. Every test here failed before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from helpers.sources import ImageLabels, sample_equal
from mmapcache import CacheFormatError, MmapCachedDataset, SampleNotCachedError, gc, verify
from mmapcache.cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
N = 16


@pytest.fixture
def filled_cache(cache_path: str) -> str:
    with MmapCachedDataset(cache_path, ImageLabels(N), ragged=None) as ds:  # no probes: exactly half filled
        ds.fill(range(8))  # half filled: the other half are misses that write
    return cache_path


# --- a writer never follows a link out of the cache ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["0.npy", "seq.u32", "filled.bits", "lock", "users", "meta.json"])
def test_a_symlinked_cache_file_is_refused_and_the_outside_file_untouched(filled_cache: str, tmp_path: Any,
                                                                         name: str) -> None:
    inside = os.path.join(filled_cache, name)
    outside = tmp_path / "precious.bin"
    with open(inside, "rb") as f:
        outside.write_bytes(f.read())  # the same bytes and size, so only the link is wrong
    before = outside.read_bytes()
    os.unlink(inside)
    os.symlink(outside, inside)
    with pytest.raises(CacheFormatError, match=rf"{name} is a symbolic link.*never writes through a link"):
        with MmapCachedDataset(filled_cache, ImageLabels(N)) as ds:
            ds[12]  # a miss: would write row 12 through the link
    # Without a source nothing is written; a reader that never needs the lock may not even open it.
    with pytest.raises((CacheFormatError, SampleNotCachedError)), MmapCachedDataset(filled_cache) as ds:
        ds[12]
    assert outside.read_bytes() == before
    result = verify(filled_cache)
    assert not result.ok and any(f"{name} is a symbolic link" in p for p in result.problems)


def test_a_hard_link_out_of_the_cache_is_refused(filled_cache: str, tmp_path: Any) -> None:
    outside = os.path.join(os.path.dirname(filled_cache), "elsewhere.npy")  # same file system, outside the cache
    os.link(os.path.join(filled_cache, "0.npy"), outside)
    with pytest.raises(CacheFormatError, match=r"0\.npy has 2 hard links"):
        MmapCachedDataset(filled_cache, ImageLabels(N))
    os.unlink(outside)


def test_verify_reports_any_entry_that_is_not_a_regular_file(filled_cache: str, tmp_path: Any,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    os.symlink(tmp_path, os.path.join(filled_cache, "extra"))
    code = main(["verify", filled_cache])
    err = capsys.readouterr().err
    assert code == 1 and "extra is a symbolic link" in err


# --- nothing beside a cache is ever removed -------------------------------------------------------------------------


def _neighbours(parent: str) -> list[str]:
    """Directories named like the leftovers of mmapcache versions before 0.2 (and of other tools), with a dead pid."""
    made = []
    for name in (".backup.tmp-999999", ".mycache.tmp-999999", ".mycache.deleting-999999",
                 ".mmapcache-new-999999-0123abcd"):  # our own pattern, but without the marker: no proof, kept
        os.makedirs(os.path.join(parent, name))
        with open(os.path.join(parent, name, "precious.txt"), "w") as f:
            f.write("precious")
        made.append(name)
    return made


def test_creation_gc_and_delete_on_close_leave_neighbours_alone(shm_dir: str) -> None:
    made = _neighbours(shm_dir)
    MmapCachedDataset(os.path.join(shm_dir, "mycache"), ImageLabels(4)).close()  # creation sweeps the parent
    assert gc(shm_dir) == []
    MmapCachedDataset(os.path.join(shm_dir, "tmpcache"), ImageLabels(4), delete_on_close=True).close()
    for name in made:
        with open(os.path.join(shm_dir, name, "precious.txt")) as f:
            assert f.read() == "precious", name
    assert sorted(os.listdir(shm_dir)) == sorted([*made, "mycache"])


def test_a_killed_creators_scratch_directory_is_still_swept(shm_dir: str) -> None:
    code = (f"import os\nfrom mmapcache.store.create import make_scratch\nmake_scratch({shm_dir!r}, 'new')\n"
            "os._exit(0)  # dies without cleaning up, as a SIGKILLed creator would")
    subprocess.run([sys.executable, "-c", code], env=ENV, timeout=60, check=True)
    assert any(n.startswith(".mmapcache-new-") for n in os.listdir(shm_dir))
    MmapCachedDataset(os.path.join(shm_dir, "c"), ImageLabels(4)).close()
    assert os.listdir(shm_dir) == ["c"]


# --- symlinked paths and long names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["delete_on_close", "overwrite"])
def test_a_symlinked_cache_path_leaves_nothing_behind(shm_dir: str, tmp_path: Any, flag: str) -> None:
    real_parent = os.path.join(shm_dir, "real")
    os.makedirs(real_parent)
    real = os.path.join(real_parent, "cache")
    MmapCachedDataset(real, ImageLabels(8), fingerprint="a", delete_on_close=flag == "delete_on_close").close() \
        if flag == "overwrite" else None
    links = tmp_path / "links"
    links.mkdir()
    link = links / "cache"
    os.symlink(real, link)
    if flag == "delete_on_close":
        ds = MmapCachedDataset(str(link), ImageLabels(8), delete_on_close=True)
        assert ds.path == real and os.path.isdir(real)
        ds.close()
        assert not os.path.exists(real)  # the real cache went, as asked
    else:
        with MmapCachedDataset(str(link), ImageLabels(8), fingerprint="b", overwrite=True) as ds:
            assert ds.path == real and sample_equal(ds[3], ImageLabels(8)[3])
    assert os.listdir(links) == ["cache"]  # only the user's link: no .cache.deleting-PID beside it
    assert os.listdir(real_parent) == ([] if flag == "delete_on_close" else ["cache"])


def test_a_250_character_name_works_and_a_256_byte_one_is_refused_clearly(shm_dir: str) -> None:
    name = "n" * 250
    with MmapCachedDataset(name, ImageLabels(4)) as ds:
        assert os.path.basename(ds.path) == name and ds.created
    with pytest.raises(ValueError, match=r"is 256 bytes long; file names are limited to 255 bytes"):
        MmapCachedDataset("n" * 256, ImageLabels(4))
    assert os.listdir(shm_dir) == [name]


# --- meta.json ------------------------------------------------------------------------------------------------------


def test_two_fields_naming_one_file_is_damage(filled_cache: str) -> None:
    path = os.path.join(filled_cache, "meta.json")
    with open(path) as f:
        meta = json.load(f)
    meta["fields"][1]["file"] = meta["fields"][0]["file"]
    with open(path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(CacheFormatError, match=r"field '1': its file '0.npy' is also the file of field '0'"):
        MmapCachedDataset(filled_cache)
    result = verify(filled_cache)  # damage is a finding of verify (exit 1), not an error
    assert not result.ok and any("is also the file of field" in p for p in result.problems)


def test_verify_with_a_source_of_another_length_is_a_mismatch_not_damage(filled_cache: str,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    result = verify(filled_cache, ImageLabels(N + 1))
    assert not result.ok and result.problems == [] and "another source" in (result.mismatch or "")
    spec = os.path.join(HERE, "helpers", "cli_sources.py")
    code = main(["verify", filled_cache, "--source", f"{spec}:images", "--kwargs", f'{{"n": {N + 3}}}'])
    err = capsys.readouterr().err
    assert code == 1 and "mismatch:" in err and "damage" not in err
