"""A CUDA run asks the caching allocator for expandable segments unless the user chose."""

from __future__ import annotations

import os

import pytest

from llmtrain.train_loop.trainer import expandable_cuda_segments


@pytest.fixture
def no_allocator_env(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


def test_set_when_the_user_chose_nothing(no_allocator_env):
    expandable_cuda_segments()
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_users_setting_is_kept(no_allocator_env, monkeypatch, name):
    monkeypatch.setenv(name, "max_split_size_mb:512")
    expandable_cuda_segments()
    assert os.environ[name] == "max_split_size_mb:512"
    other = {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} - {name}
    assert not other & set(os.environ)
