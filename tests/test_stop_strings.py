"""A stop string ends the output at the token that completes it, even when the round that
produced that token accepted drafted tokens past it: token_ids, the usage count and the
logprobs stop there too (the text is cut before the stop string, as before). The matcher
that finds it reads each round's new text once (flashtree/engine/stops.py)."""

from __future__ import annotations

import itertools
import pickle
import random

import pytest

from flashtree import LLM, FlashtreeError, SamplingParams
from flashtree.engine.stops import StopMatcher, StopStrings
from flashtree.sampling import MAX_STOP_CHARS

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


# ---- the incremental matcher -----------------------------------------------------------------------


def brute_hit(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(start, end) of the stop string that ends first in text (the longest of those ending together)."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if text[:end].endswith(s)]
        if found:
            return end - max(map(len, found)), end
    return None


def brute_held(text: str, stops: list[str]) -> int:
    """The longest tail of text that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_matcher_finds_what_a_rescan_finds_however_the_text_is_cut():
    """Fed in random pieces, the matcher reports the stop string that a full rescan finds ending
    first (the longest of those ending at the same character), and after each piece holds back
    exactly the longest tail that could still grow into a stop string. So where the engine cuts
    does not depend on how rounds split the text (overlapping stops such as "abab" and "ba"
    included)."""
    rng = random.Random(0)
    for trial in range(400):
        stops = list({"".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))})
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        want = brute_hit(text, stops)
        matcher = StopMatcher(StopStrings(stops))
        pos, hit = 0, None
        while pos < len(text) and hit is None:
            piece = text[pos: pos + rng.randint(1, 6)]
            assert matcher.feed(piece, commit=False) == (h := matcher.feed(piece))  # a peek moves nothing
            hit, pos = h, pos + len(piece)
            if hit is None:
                assert matcher.held == brute_held(text[:pos], stops), (stops, text[:pos])
        assert (tuple(hit) if hit else None) == want, (trial, stops, text)


def test_matcher_work_per_event_is_bounded_by_the_new_text():
    """The adversarial request (16 long stop strings that the text keeps almost matching, fed a
    few characters per event): every event scans at most twice its new characters plus the
    longest stop's length, and all events together at most twice the text, where rescanning
    every prefix of every stop each event (the old hold-back) read millions of characters."""
    stops = ["a" * 255 + chr(ord("b") + i) for i in range(16)]
    matcher = StopMatcher(StopStrings(stops))
    rng = random.Random(1)
    total = 0
    for _ in range(2000):
        piece = "a" * rng.randint(1, 8) + ("x" if rng.random() < 0.05 else "")
        before = matcher.scanned
        assert matcher.feed(piece) is None
        assert matcher.scanned - before <= 2 * len(piece) + 256
        total += len(piece)
        assert matcher.held <= 255
    assert matcher.scanned <= 2 * total


def test_stop_strings_are_bounded_in_size():
    """A request's stop strings may hold MAX_STOP_CHARS characters in all; more is a one-line error."""
    SamplingParams(stop=["x" * (MAX_STOP_CHARS // 2)] * 2)
    with pytest.raises(FlashtreeError, match=f"at most {MAX_STOP_CHARS}"):
        SamplingParams(stop=["x" * 100_000] * 16)


def test_matcher_pickles_without_its_tables():
    """Tensor-parallel workers receive requests (and their matchers) every round: the automaton
    travels as its strings alone."""
    stops = ["y" * 4000]
    matcher = StopMatcher(StopStrings(stops))
    matcher.feed("yyy")
    small = len(pickle.dumps(matcher))
    assert small < 4400 and pickle.loads(pickle.dumps(matcher)).held == 3
