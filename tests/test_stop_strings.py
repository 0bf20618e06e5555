"""A stop string ends the output at the token that completes it, even when the round that
produced that token accepted drafted tokens past it: token_ids, the usage count and the
logprobs stop there too (the text is cut before the stop string, as before)."""

from __future__ import annotations

import itertools

import pytest

from flashtree import LLM, SamplingParams

PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def llm():
    return LLM(method="ddtree", budget=16, device="cpu", dtype="float32", max_batch=2)


def stop_cases(llm, out, want: int = 4):
    """(token index j, stop string): j is not the last token of its round (the round drafted past
    it), and the stop string's first occurrence ends exactly with token j's text."""
    decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    texts = [decode(out.token_ids[:j]) for j in range(len(out.token_ids) + 1)]
    round_ends = set(itertools.accumulate([1] + out.stats.accept_lengths))  # the prefill emits one token
    cases = []
    for j in range(len(out.token_ids) - 1):
        if j + 1 in round_ends:
            continue
        before, after = texts[j], texts[j + 1]
        for length in (1, 2, 3, 5):
            stop = after[-length:]
            if len(after) - len(before) >= 1 and stop.strip() and after.find(stop) == len(after) - length:
                cases.append((j, stop))
                break
        if len(cases) == want:
            break
    return cases, texts


def test_tokens_past_a_stop_string_are_dropped(llm):
    full = llm.generate([PROMPT], SamplingParams(max_tokens=64, ignore_eos=True))[0]
    assert max(full.stats.accept_lengths) >= 3  # rounds accept several tokens
    cases, texts = stop_cases(llm, full)
    assert len(cases) == 4
    for j, stop in cases:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=64, ignore_eos=True, stop=[stop], logprobs=0))[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == full.token_ids[: j + 1], (j, stop)
        assert len(out.logprobs) == j + 1
        assert out.text == texts[j + 1][: texts[j + 1].find(stop)]
