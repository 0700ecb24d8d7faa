"""`deepinfer generate --no-progress` silences the weight-loading bar too (EngineConfig.load_progress=False).

The bar is tqdm on stderr with disable=not load_progress: tqdm draws it on a non-TTY stream as well
(it only hides itself when disable=None), so a captured stderr shows it unless the flag is given.
"""

from __future__ import annotations

import pytest

from deepinfer.entrypoints.cli import main

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env")


@pytest.fixture
def ckpt(tiny_cli_ckpt):
    return tiny_cli_ckpt


def _generate(capsys, ckpt, *flags: str) -> str:
    rc = main(["generate", ckpt, "hi", "--device", "cpu", "--max-tokens", "2", "--temperature", "0", *flags])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.err


def test_no_progress_silences_the_weight_loading_bar(capsys, ckpt):
    err = _generate(capsys, ckpt, "--no-progress")
    assert "Loading weights" not in err, err
    assert "loaded" in err  # the start-up line stays


def test_weight_loading_bar_shows_by_default(capsys, ckpt):
    err = _generate(capsys, ckpt)
    assert "Loading weights" in err, err


def test_no_progress_reaches_the_engine_config(monkeypatch, capsys, tmp_path):
    from deepinfer.engine import DeepInferenceEngine
    from deepinfer.errors import ConfigError

    seen = []

    def from_config(config):
        seen.append(config)
        raise ConfigError("stop here")

    monkeypatch.setattr(DeepInferenceEngine, "from_config", staticmethod(from_config))
    assert main(["generate", str(tmp_path), "hi", "--no-progress"]) == 2
    assert main(["generate", "--model", "/nonexistent", "hi"]) == 2
    capsys.readouterr()
    assert [c.load_progress for c in seen] == [False, True]
