"""DDTree inside vLLM, greedy: outputs equal vLLM's AR token for token, and every round accepts
exactly what flashtree's own engine accepts with the same tree budget."""
import pytest

pytest.importorskip("vllm")

from conftest import DRAFTER, TARGET, close, engine, generate  # noqa: E402

MAX_TOKENS = 64
BUDGETS = (4, 16, 64)


@pytest.fixture(scope="module")
def reference(demo_prompts):
    """vLLM's AR outputs, and flashtree's own DDTree acceptance per round at each budget."""
    from vllm import SamplingParams

    from flashtree import LLM, SamplingParams as FlashtreeParams

    ar = engine(speculative=False)
    outputs = [list(o.outputs[0].token_ids) for o in
               generate(ar, demo_prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    close(ar)
    accepted = {}
    for budget in BUDGETS:
        ft = LLM(TARGET, DRAFTER, method="ddtree", budget=budget, device="cpu", dtype="float32", max_batch=1)
        params = FlashtreeParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        accepted[budget] = [[n - 1 for n in ft.generate([ids], params)[0].stats.accept_lengths] for ids in demo_prompts]
    return outputs, accepted


@pytest.fixture(scope="module", params=BUDGETS)
def ddtree(request):
    # Room for eight whole trees a step: a tighter token budget makes the scheduler cut trees short,
    # still lossless (test_features) but no longer the tree flashtree verifies.
    llm = engine(request.param, max_num_batched_tokens=8 * (1 + request.param + 15))
    yield request.param, llm
    close(llm)


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_equals_ar_and_flashtree_acceptance(ddtree, reference, demo_prompts, concurrency):
    """Greedy DDTree in vLLM, one request at a time and eight in flight, emits vLLM AR's tokens, and its
    per-step accepted drafts (vLLM's own per-request metrics) equal flashtree's per round."""
    from vllm import SamplingParams

    budget, llm = ddtree
    ar_outputs, accepted = reference
    outs = generate(llm, demo_prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                    concurrency=concurrency)
    for out, expected, rounds in zip(outs, ar_outputs, accepted[budget]):
        assert list(out.outputs[0].token_ids) == expected
        assert out.outputs[0].spec_decode_metrics.per_step_accepted == rounds
