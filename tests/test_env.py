"""``attnkit._env.get``: what ``os.environ.get`` gives, as variables are set and removed
through ``os.environ``, and ``os.environ.get`` itself where there is no POSIX dictionary."""

from __future__ import annotations

import os

import pytest

from attnkit import _env

NAME = "ATTNKIT_TEST_ENV_VARIABLE"


@pytest.mark.parametrize("posix", [True, False])
def test_get_follows_os_environ(monkeypatch, posix):
    if not posix:
        monkeypatch.setattr(_env, "_DATA", None)
    monkeypatch.delenv(NAME, raising=False)
    assert _env.get(NAME) is None
    monkeypatch.setenv(NAME, "fast")
    assert _env.get(NAME) == os.environ.get(NAME) == "fast"
    os.environ[NAME] = "slow ü"  # (written through os.environ directly, non-ASCII)
    assert _env.get(NAME) == "slow ü"
    del os.environ[NAME]
    assert _env.get(NAME) is None
