"""The plugin's contract with vLLM: registered as a general plugin, idempotent, inert unless a run asks
for DDTree, inert on other vLLM versions, and one clear error at startup for settings it cannot run.
Plus the tensor pieces it adds, each against a direct reference."""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from conftest import DRAFTER, SPEC, TARGET  # noqa: E402

from flashtree.integrations.vllm import settings  # noqa: E402
from flashtree.integrations.vllm.trees import TreeBook, tree_params  # noqa: E402
from flashtree.tree import ancestor_mask, build_tree  # noqa: E402


def config(**kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=TARGET, dtype="float32", max_model_len=1024, **kwargs).create_engine_config()


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


# ---- registration ---------------------------------------------------------------------------------


def test_entry_point_is_registered():
    """vLLM finds the plugin in its general-plugins group."""
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("flashtree_ddtree") == "flashtree.integrations.vllm:register"


def test_register_twice_patches_once():
    """vLLM may load plugins more than once per process: the config hook is installed once, over vLLM's own."""
    result = run_python(
        "from vllm.engine.arg_utils import EngineArgs\n"
        "vllm_own = EngineArgs.create_engine_config\n"
        "from flashtree.integrations import vllm as plugin\n"
        "from flashtree.integrations.vllm.engine_args import EngineArgsPatch\n"
        "plugin.register(); hooked = EngineArgs.create_engine_config\n"
        "plugin._loaded = False; plugin.register()\n"
        "assert EngineArgs.create_engine_config is hooked is not vllm_own\n"
        "assert EngineArgsPatch._originals['create_engine_config'] is vllm_own\n"
        "print('ok')\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_other_vllm_version_leaves_vllm_untouched():
    """On a vLLM other than 0.32.x the plugin logs one line naming the supported version and patches nothing."""
    result = run_python(
        "import vllm\n"
        "vllm.__version__ = '0.33.1'\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "vllm_own = EngineArgs.create_engine_config\n"
        "from flashtree.integrations import vllm as plugin\n"
        "plugin.register(); plugin.register()\n"
        "assert EngineArgs.create_engine_config is vllm_own\n"
        "print('ok')\n")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "flashtree" in line]
    assert len(lines) == 1 and "0.32.x" in lines[0] and "0.33.1" in lines[0]


def test_run_without_ddtree_is_vllms():
    """Without additional_config['ddtree'] the config is vLLM's, with vLLM's worker and scheduler."""
    plain = config(speculative_config=dict(SPEC))
    assert plain.parallel_config.worker_cls == settings.CPU_WORKER
    assert plain.scheduler_config.scheduler_cls is None


def test_a_chain_engine_keeps_working_beside_a_ddtree_engine_in_one_process():
    """Patches land on vLLM's classes when a DDTree engine starts; an engine built before them in the same
    process (the engine core in-process) still runs as vLLM's chain, with AR's greedy tokens."""
    result = run_python(
        "import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\n"
        "from vllm import LLM, SamplingParams\n"
        f"kw = dict(model={TARGET!r}, dtype='float32', max_model_len=512, seed=0, enforce_eager=True)\n"
        "p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)\n"
        "ids = [{'prompt_token_ids': [5, 17, 300, 42, 9]}]\n"
        "ar = LLM(**kw).generate(ids, p, use_tqdm=False)[0].outputs[0].token_ids\n"
        f"chain = LLM(speculative_config={SPEC!r}, **kw)\n"
        f"tree = LLM(speculative_config={SPEC!r}, additional_config={{'ddtree': {{'budget': 8}}}}, **kw)\n"
        "for llm in (chain, tree, chain):\n"
        "    assert llm.generate(ids, p, use_tqdm=False)[0].outputs[0].token_ids == ar\n"
        "print('ok')\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_ddtree_run_gets_flashtrees_worker_and_scheduler():
    chosen = config(speculative_config=dict(SPEC), additional_config={"ddtree": {"budget": 24}})
    assert chosen.parallel_config.worker_cls == settings.DDTREE_WORKER
    assert chosen.scheduler_config.scheduler_cls == settings.DDTREE_SCHEDULER
    assert settings.settings_of(chosen) == settings.DDTreeSettings(budget=24, depth=15)


# ---- bad settings: one error at startup, before any engine -----------------------------------------

BAD = [
    ({"ddtree": {"budget": 0}}, {}, "budget must be an integer in 1..1024"),
    ({"ddtree": {"budget": "64"}}, {}, "budget must be an integer"),
    ({"ddtree": {"budget": 2000}}, {}, "budget must be an integer in 1..1024"),
    ({"ddtree": {"budjet": 8}}, {}, "unknown additional_config['ddtree'] key"),
    ({"ddtree": 64}, {}, "must be an object"),
    ({"ddtree": {"budget": 64}}, {"max_num_batched_tokens": 64}, "needs 80 batched tokens"),
]


@pytest.mark.parametrize("extra,kwargs,message", BAD)
def test_bad_settings_fail_at_startup(extra, kwargs, message):
    """Each bad setting stops the config with one DDTreeConfigError naming what to change."""
    with pytest.raises(settings.DDTreeConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config(speculative_config=dict(SPEC), additional_config=extra, **kwargs)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}])
def test_ddtree_needs_a_dflash_drafter(spec):
    with pytest.raises(settings.DDTreeConfigError, match="DFlash drafter"):
        config(speculative_config=spec, additional_config={"ddtree": {"budget": 8}})


def test_v2_runner_is_refused(monkeypatch):
    """A config that would run vLLM's V2 runner (GPUs, by default) is refused by name. vLLM's CPU build
    cannot run V2 at all, so the property is forced here."""
    from vllm.config import VllmConfig

    base = config(speculative_config=dict(SPEC), additional_config={"ddtree": {"budget": 8}})
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    with pytest.raises(settings.DDTreeConfigError, match="V1 model runner"):
        settings.validate(base)


def test_non_dflash1_drafter_is_refused():
    """A drafter whose checkpoint is not DFlash-1 (here: the DFlash2 demo drafter's architecture) is refused."""
    base = config(speculative_config=dict(SPEC), additional_config={"ddtree": {"budget": 8}})
    base.speculative_config.draft_model_config.hf_config.architectures = ["DFlash2DraftModel"]
    with pytest.raises(settings.DDTreeConfigError, match="DFlash-1 drafter"):
        settings.validate(base)


# ---- the pieces ------------------------------------------------------------------------------------


def test_chain_part_keeps_chains_and_tree_roots():
    """The rejection sampler's share of a step: chain requests whole, each tree request as its root row alone."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from flashtree.integrations.vllm.chain import chain_part

    drafts = [3, 5, 0, 2]  # request 1 verifies a tree of 5 nodes past the root
    tokens = [[11, 12, 13], [21, 22, 23, 24, 25], [], [41, 42]]
    meta = SpecDecodeMetadata.make_dummy(tokens, torch.device("cpu"))
    meta.logits_indices = torch.arange(sum(d + 1 for d in drafts), dtype=torch.int32)
    part, rows = chain_part(meta, np.array([1]))
    assert part.num_draft_tokens == [3, 0, 0, 2]
    assert part.draft_token_ids.tolist() == [11, 12, 13, 41, 42]
    assert rows.tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13]  # request 1 keeps row 4, its root
    assert part.target_logits_indices.tolist() == [0, 1, 2, 6, 7]
    assert part.bonus_logits_indices.tolist() == [3, 4, 5, 8]
    assert part.cu_num_sampled_tokens.tolist() == [4, 5, 6, 9]


def test_expand_batch_to_tokens_repeats_each_requests_value():
    """The stand-in for vLLM's expansion keeps float and int32 values (vLLM's CPU kernel left them uninitialised)."""
    from flashtree.integrations.vllm.chain import expand_batch_to_tokens

    cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)
    temps = expand_batch_to_tokens(torch.tensor([0.8, 0.0, 2.0, 1.5]), cu, 6, replace_from=0, replace_to=1)
    assert temps.tolist() == pytest.approx([0.8, 0.8, 1.0, 1.0, 1.0, 1.5])
    assert expand_batch_to_tokens(torch.tensor([20, 4096, 7, 5], dtype=torch.int32), cu, 6).tolist() == [
        20, 20, 4096, 4096, 4096, 5]


def test_paged_kv_reads_what_vllms_cache_op_wrote():
    """paged_kv decodes the CPU cache layout vLLM's own write produces (the startup check does the same)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from flashtree.integrations.vllm.attention import check_layout

    for dtype in (torch.float32, torch.bfloat16):
        isa = _get_attn_isa(dtype, 128, 64)
        check_layout(dtype, 128, 64, "vec" if isa == "amx" else isa)


@pytest.mark.parametrize("layout", ["adjacent", "gap", "single", "single-block"])
def test_tree_attention_matches_dense_masked_attention(layout):
    """Tree rows attend their request's committed keys and their own ancestors only, all read from the
    paged cache (vLLM writes a node's K/V at position prefix + node index before attention runs).
    Layouts: two adjacent full trees; a cut tree after another request's rows; one tree whose blocks
    are consecutive (read as strided views of the cache), over two blocks or within one."""
    from vllm import _custom_ops as ops

    from flashtree.integrations.vllm.attention import tree_attention
    from flashtree.integrations.vllm.verify import VerifyPlan, ancestors

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block, num_blocks = 4, 2, 64, 32, 8
    cache = torch.zeros(num_blocks, kv_heads, block, 2 * dim)
    key_cache, value_cache = cache.view(num_blocks, kv_heads, 2 * block, dim).chunk(2, dim=2)
    single = layout.startswith("single")
    trees = 1 if single else 2
    prefix = [7] if layout == "single-block" else [40, 7][:trees]  # committed tokens of the trees' requests
    tables = torch.tensor([[3, 4, 0], [6, 0, 0]] if single else [[5, 2, 0], [6, 0, 0]],
                          dtype=torch.int32)
    spec = build_tree(torch.tensor([1, 2][:trees]), torch.randn(trees, 4, 50, generator=gen), 6)
    sizes = torch.tensor([7, 5]) if layout == "gap" else spec.sizes  # a tree the scheduler cut to 5 nodes
    N = spec.tokens.shape[1]
    gap = 3 if layout == "gap" else 0  # another request's rows between the trees
    start = torch.tensor([0, int(sizes[0]) + gap][:trees])
    T = int(start[-1] + sizes[-1])
    q = torch.randn(T, heads, dim, generator=gen)
    k = torch.randn(T, kv_heads, dim, generator=gen)
    v = torch.randn(T, kv_heads, dim, generator=gen)
    old_k = [torch.randn(p, kv_heads, dim, generator=gen) for p in prefix]
    old_v = [torch.randn(p, kv_heads, dim, generator=gen) for p in prefix]
    for r, p in enumerate(prefix):
        n = int(sizes[r])
        position = torch.arange(p + n)
        slots = tables[r, position // block].long() * block + position % block
        rows = slice(int(start[r]), int(start[r]) + n)
        ops.cpu_attn_reshape_and_cache(torch.cat([old_k[r], k[rows]]), torch.cat([old_v[r], v[rows]]),
                                       key_cache, value_cache, slots, "vec")
    node = torch.arange(N)
    mask = ancestor_mask(spec)
    assert torch.equal(torch.from_numpy(ancestors(spec.parents.numpy(), spec.depth_bound)), mask)
    plan = VerifyPlan(req_ids=["a", "b"][:trees], req_index=torch.arange(trees), start=start, size=sizes,
                      prefix=torch.tensor(prefix), spec=spec, params=[], seeds=[],
                      rows=start[:, None] + torch.minimum(node, sizes[:, None] - 1), valid=node < sizes[:, None],
                      mask=mask, row_slice=None if layout == "gap" else slice(0, trees * N))
    impl = type("Impl", (), {"num_heads": heads, "num_kv_heads": kv_heads, "head_size": dim, "scale": dim ** -0.5})
    out = torch.zeros(T, heads * dim) if layout != "single-block" else torch.zeros(T, heads, dim)
    tree_attention(impl, q, cache, tables, plan, out)
    assert (plan.attention(tables, block, kv_heads, heads // kv_heads).first_block is not None) == single

    for r in range(trees):
        for i in range(int(sizes[r])):
            row = int(start[r]) + i
            seen = int(start[r]) + torch.tensor([j for j in range(int(sizes[r])) if mask[r, i, j]])
            keys, values = torch.cat([old_k[r], k[seen]]), torch.cat([old_v[r], v[seen]])
            for h in range(heads):
                g = h // (heads // kv_heads)
                w = torch.softmax(keys[:, g] @ q[row, h] * dim ** -0.5, 0)
                assert torch.allclose(out.view(T, heads, dim)[row, h], w @ values[:, g], atol=1e-5)


def test_move_kv_copies_slots_in_the_cache_layout():
    """The commit's copy within a cache moves exactly the K/V vLLM's write op put at the source slots."""
    from vllm import _custom_ops as ops

    from flashtree.integrations.vllm.attention import move_kv, paged_kv

    gen = torch.Generator().manual_seed(2)
    heads, dim, block, blocks = 2, 64, 32, 3
    cache = torch.zeros(blocks, heads, block, 2 * dim)
    key_cache, value_cache = cache.view(blocks, heads, 2 * block, dim).chunk(2, dim=2)
    k, v = torch.randn(blocks * block, heads, dim, generator=gen), torch.randn(blocks * block, heads, dim, generator=gen)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(blocks * block), "vec")
    src, dst = torch.tensor([35, 40, 70]), torch.tensor([33, 34, 35])  # the last destination was the first source
    move_kv([cache], src, dst)
    keys, values = paged_kv(cache, torch.arange(blocks)[None])
    expected_k, expected_v = k.clone(), v.clone()
    expected_k[dst], expected_v[dst] = k[src], v[src]
    assert torch.equal(keys[0].transpose(0, 1), expected_k) and torch.equal(values[0].transpose(0, 1), expected_v)


def test_walk_bookkeeping_moves_the_accepted_path():
    """After a walk, the accepted nodes' K/V go to the slots of their path positions, and the drafter
    reads the path first, then the other nodes."""
    from flashtree.integrations.vllm.accept import Walked, drafter_order, kv_moves, output_rows
    from flashtree.integrations.vllm.verify import VerifyPlan

    # root 0 -> {1, 2}; 2 -> 3; the walk accepts 0, 2, 3 (emitting tokens of 2, 3 and a bonus)
    spec_tokens = torch.tensor([[9, 10, 20, 30]])
    spec = dataclasses.replace(build_tree(torch.tensor([9]), torch.zeros(1, 2, 40), 3), tokens=spec_tokens,
                               parents=torch.tensor([[-1, 0, 0, 2]]), depths=torch.tensor([[0, 1, 1, 2]]),
                               sizes=torch.tensor([4]), max_depth=2)
    plan = VerifyPlan(req_ids=["a"], req_index=torch.tensor([1]), start=torch.tensor([5]), size=torch.tensor([4]),
                      prefix=torch.tensor([100]), spec=spec, params=[], seeds=[], rows=torch.tensor([[5, 6, 7, 8]]),
                      valid=torch.ones(1, 4, dtype=torch.bool), mask=ancestor_mask(spec))
    walked = Walked(plan, path=torch.tensor([[0, 2, 3]]), num_nodes=torch.tensor([3]), tokens=torch.tensor([[20, 30, 77]]))
    src, dst = kv_moves(walked)
    assert list(zip(src.tolist(), dst.tolist())) == [(7, 6), (8, 7)]  # node 2 to position 101, node 3 to 102
    assert drafter_order(walked, 10).tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 6, 9]
    sampled = torch.tensor([[1, -1], [4, -1], [5, 6]], dtype=torch.int32)
    assert output_rows(sampled, walked).tolist() == [[1, -1, -1], [20, 30, 77], [5, 6, -1]]


def test_walk_on_the_host_is_flashtrees_accept_walk():
    """The plugin's host walk accepts what flashtree's accept_walk accepts, on built trees (a cut one
    among them) with picks that follow the trees for a while, then leave them."""
    from flashtree.integrations.vllm.accept import follow, greedy_picks
    from flashtree.tree import accept_walk

    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        R, D, V = 3, 6, 12
        spec = build_tree(torch.arange(R), torch.randn(R, D, V, generator=gen) * 2, 10)
        if trial % 2:  # the last row cut to 4 nodes, as the scheduler may cut it
            N = spec.tokens.shape[1]
            cut = torch.arange(N) >= 4
            spec = dataclasses.replace(spec, tokens=spec.tokens.masked_fill(cut & (torch.arange(R) == R - 1)[:, None], -1),
                                       sizes=torch.minimum(spec.sizes, torch.tensor([99, 99, 4])))
        # picks: each node's best child's token with probability 0.7, else a random token
        N = spec.tokens.shape[1]
        child = torch.full((R, N), -1, dtype=torch.long)
        for r in range(R):
            for i in reversed(range(1, N)):
                if spec.tokens[r, i] >= 0:
                    child[r, spec.parents[r, i]] = spec.tokens[r, i]
        noise = torch.randint(0, V, (R, N), generator=gen)
        follow_tree = (torch.rand(R, N, generator=gen) < 0.7) & (child >= 0)
        logits = torch.nn.functional.one_hot(torch.where(follow_tree, child, noise), V).float()
        picks = greedy_picks(logits)
        expected = accept_walk(spec, logits.argmax(-1))
        path, num_nodes, tokens = follow(spec.tokens.numpy(), spec.parents.numpy(), picks.numpy(), spec.depth_bound)
        assert path.tolist() == expected.path.tolist()
        assert num_nodes.tolist() == expected.num_nodes.tolist()
        assert tokens.tolist() == expected.tokens.tolist()


def test_tree_book_drafts_trees_for_tree_rows_only():
    """Tree rows get flashtree's exact tree as their draft list (depth-then-rank order); other rows keep their chain."""
    from vllm import SamplingParams

    book = TreeBook(budget=5)
    logits = torch.randn(2, 3, 30, generator=torch.Generator().manual_seed(1))
    params = tree_params(SamplingParams(temperature=0), "raw_logprobs")
    drafts = book.draft(["a", "b"], [1], [params], torch.tensor([3, 4]), logits, [[7, 8, 9], [1, 2, 3]])
    spec = build_tree(torch.tensor([4]), logits[1:], 5)
    assert drafts[0] == [7, 8, 9]
    assert drafts[1] == spec.tokens[0, 1:].tolist() and set(book.trees) == {"b"}
    assert book.trees["b"].parents.tolist() == spec.parents[0].tolist()


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 0.5}, {"frequency_penalty": 0.1}, {"repetition_penalty": 1.2}, {"bad_words": ["x"]},
    {"min_tokens": 4}, {"logit_bias": {3: 1.0}}, {"allowed_token_ids": [1, 2]}, {"min_p": 0.1},
])
def test_requests_that_need_the_chain(kwargs):
    """Penalties, bad words, min_tokens, logit bias, allowed tokens and min_p keep vLLM's chain."""
    from vllm import SamplingParams

    assert tree_params(SamplingParams(temperature=0.7, **kwargs), "raw_logprobs") is None


def test_structured_output_and_processed_logprobs_need_the_chain():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    structured = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    assert tree_params(structured, "raw_logprobs") is None
    assert tree_params(SamplingParams(logprobs=2), "processed_logprobs") is None
    sampled = tree_params(SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, logprobs=2), "raw_logprobs")
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.seed) == (0.8, 0.9, 20, 7)
    assert tree_params(SamplingParams(temperature=0.0), "raw_logprobs").greedy
