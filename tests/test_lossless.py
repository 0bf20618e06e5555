"""Greedy DFlash and DDTree emit exactly the tokens AR emits, alone or batched."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from tiny import make_drafter, make_target, synthetic_cost

VOCAB = 16
PROMPTS = [[1, 2, 3], [4], list(range(1, 15)) * 2, [7, 7, 7, 7, 7, 7, 9]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    target = make_target(root / "target", vocab=VOCAB, logit_scale=3.0)
    drafters = {b: make_drafter(root / f"drafter{b}", target_layers=4, vocab=VOCAB, block_size=b, seed=b)
                for b in (4, 8, 16)}
    return target, drafters


def generate(target, drafter, method, budget, prompts, params, max_batch=4, dtype="float32"):
    llm = LLM(str(target), drafter and str(drafter), method=method, budget=budget, device="cpu",
              dtype=dtype, max_batch=max_batch, max_model_len=256)
    return llm.generate(prompts, params)


@pytest.fixture(scope="module")
def reference(models):
    """AR outputs, each prompt run alone."""
    target, _ = models
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    return [generate(target, None, "ar", 1, [p], params, max_batch=1)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("block", [4, 8, 16])
@pytest.mark.parametrize("method,budget", [("dflash", 1), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16),
                                           ("ddtree", 64), ("ddtree", 256)])
def test_greedy_matches_ar(models, reference, block, method, budget):
    """Batched (3 slots for 4 prompts, so one queues) speculative output == AR run alone."""
    target, drafters = models
    outs = generate(target, drafters[block], method, budget, PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True),
                    max_batch=3)
    assert [o.token_ids for o in outs] == reference
    if method == "ddtree" and budget >= 64:
        # Big trees over a 16-token vocabulary accept deep paths: the compaction path is exercised.
        assert max(max(o.stats.accept_lengths) for o in outs) >= 3


def test_float64_greedy_matches_ar(models):
    target, drafters = models
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ref = generate(target, None, "ar", 1, PROMPTS, params, dtype="float64")
    out = generate(target, drafters[8], "ddtree", 32, PROMPTS, params, dtype="float64")
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


@pytest.mark.parametrize("method,budget", [("dflash", 1), ("ddtree", 64)])
def test_stop_tokens_and_max_tokens_trim_mid_round(models, reference, method, budget):
    """A stop id or max_tokens inside a round cuts the output exactly where AR would stop."""
    target, drafters = models
    full = reference[2]
    stop_at = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    stop_tok = full[stop_at]
    out = generate(target, drafters[8], method, budget, [PROMPTS[2]],
                   SamplingParams(max_tokens=48, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert out.token_ids == full[:stop_at] and out.finish_reason == "stop"
    for n in (1, 2, 5, 11):
        out = generate(target, drafters[8], method, budget, [PROMPTS[2]], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        assert out.token_ids == full[:n] and out.finish_reason == "length"


def test_eos_from_config_stops(models, reference):
    """The checkpoint's EOS (vocab-1 in the tiny configs) ends generation when it is produced."""
    target, drafters = models
    eos = VOCAB - 1
    params = SamplingParams(max_tokens=48)
    for prompt, full in zip(PROMPTS, reference):
        out = generate(target, drafters[4], "ddtree", 16, [prompt], params)[0]
        want = full[: full.index(eos)] if eos in full else full
        assert out.token_ids == want


def test_prompt_lengths(models):
    """Prompts of many lengths (1..60) give AR-identical output."""
    target, drafters = models
    prompts = [[(i * 7 + j) % (VOCAB - 2) for j in range(n)] for i, n in enumerate((1, 2, 9, 31, 60))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = generate(target, None, "ar", 1, prompts, params)
    out = generate(target, drafters[16], "ddtree", 128, prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_stop_strings_trim_text_exactly(tmp_path):
    """A stop string completed inside a round cuts the text right before it, as with AR."""
    import shutil

    from flashtree.config import DEMO_TARGET

    tok_files = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    if not all((DEMO_TARGET / f).is_file() for f in tok_files):
        pytest.skip("the demo tokenizer is not built yet")
    target = make_target(tmp_path / "t", vocab=4096, hidden=32, logit_scale=4.0)
    for f in tok_files:
        shutil.copy(DEMO_TARGET / f, target / f)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=4096, block_size=8)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    full = generate(target, None, "ar", 1, ["def f(x):"], params)[0].text
    assert len(full) > 12
    stop = full[9:12]
    cut = full[: full.index(stop)]
    for method, budget in (("ar", 1), ("dflash", 1), ("ddtree", 64)):
        out = generate(target, drafter, method, budget, ["def f(x):"],
                       SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
        assert out.text == cut and out.finish_reason == "stop"


def test_budget_1024_block_16(models, reference):
    """The largest budget runs through the whole engine and stays lossless."""
    target, drafters = models
    outs = generate(target, drafters[16], "ddtree", 1024, PROMPTS[:2], SamplingParams(max_tokens=48, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference[:2]


def test_incremental_detokenization_equals_full_decode():
    """Text built round by round (any chunking, characters split across tokens) == one decode."""
    from flashtree.config import DEMO_TARGET
    from flashtree.engine.llm_engine import load_tokenizer
    from flashtree.engine.output import OutputProcessor
    from flashtree.engine.sequence import Request

    tok = load_tokenizer(DEMO_TARGET)
    if tok is None:
        pytest.skip("the demo tokenizer is not built yet")
    output = OutputProcessor(tok, set(), 1 << 30)
    text = "déjà vu — 中文字符 and emoji 🙂 in code: x = 'ü'\n"
    ids = tok.encode(text, add_special_tokens=False)
    for chunk in (1, 2, 3, 7):
        req = Request([1], SamplingParams())
        pieces = []
        for i in range(0, len(ids), chunk):
            new = ids[i : i + chunk]
            piece, offsets = output.detokenize(req, new, final=i + chunk >= len(ids))
            req.output_ids.extend(new)
            if offsets is not None:
                req.prefix_offset, req.read_offset = offsets
            assert "\ufffd" not in piece
            pieces.append(piece)
        assert "".join(pieces) == text


@pytest.mark.parametrize("method,budget", [("ar", 1), ("dflash", 1), ("ddtree", 100), ("ddtree", "auto")])
def test_static_shapes_match_ar(models, reference, method, budget):
    """Padded to shape buckets (batch 3 -> 4 rows with a dummy slot, keys to 128/256, budget 100 cut
    to the candidate 32 by max_round_tokens, prompts in power-of-two chunks), output == AR alone."""
    target, drafters = models
    llm = LLM(str(target), None if method == "ar" else str(drafters[8]), method=method, budget=budget,
              max_budget=64, device="cpu", max_batch=3, max_model_len=256, static_shapes=True,
              max_round_tokens=150)
    runner = llm.engine.runner
    assert runner.max_rows == 4 and runner.cache.k.shape[1] == 4  # 3 slots + the dummy
    if budget == "auto":  # costs where drafting pays, so its rounds draft whatever this machine measured
        runner.policy.cost = synthetic_cost(1e-5, draft=5e-4, rows=4)
        runner.policy.cost.frozen = True
    if method == "ddtree" and budget == 100:
        assert runner.round_budget(4) == 32
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference
    if method != "ar":
        assert max(max(o.stats.accept_lengths) for o in outs) >= 3


def test_static_prefill_chunks_are_powers_of_two():
    """With static shapes a prompt chunk runs as power-of-two pieces, largest first, each <= 512."""
    from flashtree.engine.shapes import prefill_chunks

    assert prefill_chunks(0, 300, static=True) == [(0, 256), (256, 288), (288, 296), (296, 300)]
    assert prefill_chunks(40, 1100, static=True)[:2] == [(40, 552), (552, 1064)]
    assert prefill_chunks(0, 1100, static=False) == [(0, 512), (512, 1024), (1024, 1100)]
