"""Bad input gets one clear FlashtreeError (or a one-line CLI error) naming the fix."""

from __future__ import annotations

import pytest

from flashtree import LLM, EngineConfig, FlashtreeError, SamplingParams
from flashtree.cli import main
from tiny import make_drafter, make_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    return make_target(root / "t", vocab=32), make_drafter(root / "d", target_layers=4, vocab=32)


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "beam"}, "unknown method 'beam'; choose one of ar, dflash, ddtree"),
    ({"budget": 0}, "budget must be an integer in 1..1024"),
    ({"budget": 5000}, "budget must be an integer in 1..1024"),
    ({"method": "ddtree", "target": "/x", "drafter": None}, "needs a drafter"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(FlashtreeError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -5}, "top_k"),
])
def test_sampling_param_errors(kwargs, match):
    with pytest.raises(FlashtreeError, match=match):
        SamplingParams(**kwargs)


def test_prompt_errors(pair):
    target, drafter = pair
    llm = LLM(str(target), str(drafter), device="cpu", max_model_len=16)
    with pytest.raises(FlashtreeError, match="prompt has 20 tokens but the context holds 16"):
        llm.generate([list(range(20))])
    with pytest.raises(FlashtreeError, match="prompt is empty"):
        llm.generate([[]])
    with pytest.raises(FlashtreeError, match=r"integers in \[0, 32\)"):
        llm.generate([[1, 99]])
    with pytest.raises(FlashtreeError, match="ships no tokenizer"):
        llm.generate(["text"])
    # The engine still works after refusing bad input.
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_cli_prints_one_line_error(capsys, tmp_path):
    code = main(["generate", "hi", "--target", str(tmp_path / "missing"), "--method", "ar"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("flashtree: error: no such model directory")
    code = main(["generate", "hi", "--method", "nope"])
    assert code == 2 and "unknown method" in capsys.readouterr().err
