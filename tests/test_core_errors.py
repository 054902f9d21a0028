"""The exception hierarchy: every class is re-exported, builds from one message string (how DataLoader re-raises
a worker's exception), pickles with its message, and inherits the builtin a caller would catch; errors raised by
real calls pickle too."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import mmapcache
from helpers.sources import ImageLabels
from mmapcache import errors

BUILTINS = {
    "CacheNotFoundError": FileNotFoundError,
    "CacheFormatError": ValueError,
    "CacheMismatchError": ValueError,
    "CacheReadOnlyError": PermissionError,
    "InsufficientSpaceError": OSError,
    "SampleNotCachedError": KeyError,
    "LayoutError": TypeError,
}


def test_every_error_is_re_exported_and_in_the_hierarchy() -> None:
    names = [name for name in errors.__all__ if name != "MmapCacheError"]
    assert set(BUILTINS) <= set(names)
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert getattr(mmapcache, name) is cls and name in mmapcache.__all__
        if name.endswith("Warning"):
            assert issubclass(cls, UserWarning) and not issubclass(cls, errors.MmapCacheError)
        else:
            assert issubclass(cls, errors.MmapCacheError) and issubclass(cls, Exception)
    for name, builtin in BUILTINS.items():
        assert issubclass(getattr(errors, name), builtin), f"{name} should also be a {builtin.__name__}"


@pytest.mark.parametrize("name", errors.__all__)
def test_built_from_one_string_and_picklable(name: str) -> None:
    cls = getattr(errors, name)
    message = f"sample 3 of /dev/shm/x: {name} happened; fix it with overwrite=True"
    exc = cls(message)
    assert str(exc) == message  # SampleNotCachedError too: no KeyError-style quoting
    rebuilt = type(exc)(str(exc))  # what torch's ExceptionWrapper.reraise does
    assert type(rebuilt) is cls and str(rebuilt) == message
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is cls and str(copy) == message and copy.args == (message,)
    with pytest.raises(cls, match="sample 3"):
        raise copy


def _raised(call: Any) -> BaseException:
    try:
        call()
    except errors.MmapCacheError as exc:
        return exc
    raise AssertionError("no MmapCacheError was raised")


def test_errors_raised_by_real_calls_pickle_with_their_message(cache_path: str, shm_dir: str) -> None:
    mmapcache.MmapCachedDataset(cache_path, ImageLabels(4), ragged=None).close()  # sample 0 stored, 2 not
    ro = mmapcache.MmapCachedDataset(cache_path)
    raised = [
        _raised(lambda: ro[2]),
        _raised(lambda: mmapcache.MmapCachedDataset(cache_path, ImageLabels(5))),
        _raised(lambda: mmapcache.MmapCachedDataset(f"{shm_dir}/nothing")),
        _raised(lambda: mmapcache.MmapCachedDataset(f"{shm_dir}/nones", [None] * 3)),
    ]
    ro.close()
    expected = [errors.SampleNotCachedError, errors.CacheMismatchError, errors.CacheNotFoundError, errors.LayoutError]
    assert [type(exc) for exc in raised] == expected
    for exc in raised:
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc) and str(copy) == str(exc) and len(str(exc)) > 30
