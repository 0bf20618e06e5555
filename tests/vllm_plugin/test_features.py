"""vLLM's other features with trees on: logprobs gathered at the accepted nodes, requests that need
the chain (penalties, bad words, min_tokens, structured output) in the same batches as trees,
prefix caching and chunked prefill. Greedy outputs are compared with vLLM's AR engine."""
import json
import re

import pytest

pytest.importorskip("vllm")

from conftest import BATCHED, close, engine, generate  # noqa: E402

MAX_TOKENS = 40
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{4}"


def requests(demo_prompts):
    """(prompt, SamplingParams) pairs mixing tree and chain requests; greedy, so AR fixes every output."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    def params(**kw):
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw)

    long_prompt = sum(demo_prompts, [])[:3 * BATCHED]  # takes chunked prefill
    return [
        (demo_prompts[0], params(ignore_eos=True, logprobs=3)),
        (demo_prompts[1], params(ignore_eos=True, repetition_penalty=1.3)),
        (demo_prompts[2], params(ignore_eos=True, presence_penalty=0.6, frequency_penalty=0.2)),
        (demo_prompts[3], params(ignore_eos=True, min_tokens=10, bad_words=["return"])),
        (demo_prompts[4], params(structured_outputs=StructuredOutputsParams(regex=REGEX))),
        (demo_prompts[5], params(structured_outputs=StructuredOutputsParams(json=SCHEMA))),
        (demo_prompts[6], params(ignore_eos=True)),
        (long_prompt, params(ignore_eos=True)),
    ]


@pytest.fixture(scope="module")
def outputs(demo_prompts):
    """The mixed batch on vLLM AR, then on DDTree twice (the second time its prompts hit the prefix cache)."""
    pairs = requests(demo_prompts)
    ids, params = [p for p, _ in pairs], [q for _, q in pairs]

    def run(llm):
        return llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)

    ar = engine(speculative=False, structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    reference = run(ar)
    close(ar)
    llm = engine(16, structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    first, second = run(llm), run(llm)
    sequential = [generate(llm, [p], q, concurrency=1)[0] for p, q in pairs]
    close(llm)
    return reference, first, second, sequential


@pytest.mark.slow
def test_mixed_batch_equals_ar(outputs):
    """Tree requests, chain requests (penalties, bad words, min_tokens, structured output) and a chunked
    long prompt, batched together, emit vLLM AR's greedy tokens."""
    reference, first, _, sequential = outputs
    for ref, got, alone in zip(reference, first, sequential):
        assert list(got.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
        assert list(alone.outputs[0].token_ids) == list(ref.outputs[0].token_ids)


@pytest.mark.slow
def test_structured_output_is_valid(outputs):
    _, first, _, _ = outputs
    assert re.fullmatch(REGEX, first[4].outputs[0].text)
    doc = json.loads(first[5].outputs[0].text)
    assert doc["answer"] in ("yes", "no", "maybe") and isinstance(doc["sure"], bool)


@pytest.mark.slow
def test_logprobs_are_the_accepted_nodes_rows(outputs):
    """Logprobs of a tree request are those AR computes for the same tokens: the rows of the nodes that
    emitted them, not the rows at their index in the draft list."""
    reference, first, _, _ = outputs
    ref, got = reference[0].outputs[0], first[0].outputs[0]
    assert got.spec_decode_metrics is not None and max(got.spec_decode_metrics.per_step_accepted) > 0
    assert len(got.logprobs) == len(ref.logprobs) == MAX_TOKENS
    for token, mine, theirs in zip(got.token_ids, got.logprobs, ref.logprobs):
        assert set(mine) == set(theirs)
        assert mine[token].rank == theirs[token].rank
        for t in mine:
            assert mine[t].logprob == pytest.approx(theirs[t].logprob, abs=1e-4)


@pytest.mark.slow
def test_prefix_cache_hits_keep_outputs(outputs):
    """Run again, the batch hits vLLM's prefix cache (blocks the trees' compaction wrote) and emits the same tokens."""
    reference, _, second, _ = outputs
    assert sum(o.num_cached_tokens or 0 for o in second) > 0
    for ref, got in zip(reference, second):
        assert list(got.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
