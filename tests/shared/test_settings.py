"""Worker flags and their environment twins reach the engine's keyword arguments; bad values are
one clear line."""

import pytest

from kernels.ops import BACKENDS
from shared.settings import ATTENTION_BACKENDS, cache_dir, worker_settings


def test_the_attention_backend_flag_offers_what_the_kernels_offer():
    assert ATTENTION_BACKENDS == BACKENDS


def test_the_attention_backend_comes_from_the_flag_or_the_environment():
    assert worker_settings([], {}).engine["attention_backend"] == "auto"
    assert worker_settings(["--attention-backend", "torch"], {}).engine["attention_backend"] == "torch"
    assert worker_settings([], {"PAGEDSERVE_ATTENTION_BACKEND": "native"}).engine["attention_backend"] == "native"


def test_an_unknown_attention_backend_is_refused(capsys):
    with pytest.raises(SystemExit):
        worker_settings(["--attention-backend", "cuda"], {})
    assert "invalid choice: 'cuda'" in capsys.readouterr().err


def test_the_cache_directory_follows_the_environment(tmp_path):
    assert cache_dir({"PAGEDSERVE_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "pagedserve"
