"""DFlash2 checkpoints load, and their drafts equal a from-scratch implementation of the layout."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from flashtree import LLM, SamplingParams
from flashtree.errors import FlashtreeError
from flashtree.models.dflash2 import DFlash2Args, DFlash2Drafter, load_drafter, save_drafter
from flashtree.models.context import ForwardContext
from flashtree.models.loader import load_target
from test_drafter import hf_features, rms, rope
from tiny import make_target

CPU = torch.device("cpu")


def make_dflash2_drafter(out: Path, target_layers: int, vocab: int = 64, hidden: int = 32, layers: int = 2,
                         block_size: int = 6, layer_ids: list[int] | None = None, top_k: int = 5, rank: int = 6,
                         taps: int = 3, group: int = 8, seed: int = 1, scale: float = 1.3, multiplier: float = 0.8,
                         softcap: float | None = 4.0, pair_std: float = 0.5) -> Path:
    """A random DFlash2 drafter: nonzero conv deltas and selector terms, non-trivial scalings."""
    torch.manual_seed(seed)
    args = DFlash2Args(hidden_size=hidden, intermediate_size=hidden * 2, num_layers=layers, num_heads=4,
                       num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-6, block_size=block_size,
                       target_layer_ids=layer_ids or [1, target_layers - 2], num_target_layers=target_layers,
                       mask_token_id=vocab - 2, vocab_size=vocab, layer_types=["full_attention"] * layers,
                       selector_rank=rank, selector_top_k=top_k, conv_kernel_size=taps, conv_group_size=group,
                       input_embedding_scale=scale, output_multiplier=multiplier, final_logit_softcapping=softcap)
    drafter = DFlash2Drafter(args)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "codebook" in name:
                p.normal_(0, pair_std)
            elif "base_kernel" in name:
                p.normal_(0, 0.4)
            else:
                p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    save_drafter(drafter, out)
    return out


# ----------------------------------------------------------------------------- the reference


def conv_ref(y, delta, base, group):
    """out[i] = sum_{t <= i} (base[t] + delta[i, t] per group) * y[i - t], one slot at a time."""
    taps = base.shape[0]
    out = torch.zeros_like(y)
    for i in range(y.shape[0]):
        for t in range(taps):
            if i - t >= 0:
                w = base[t] + delta[i, t].repeat_interleave(group)
                out[i] = out[i] + w * y[i - t]
    return out


def reference_dflash2(drafter_dir, target_dir, features, block, start):
    """The DFlash2 draft written from its definition: unary logits [L-1, V] and, per depth, the
    candidates and every predecessor's conditional log-probs, plus the greedy chain."""
    cfg = json.loads((drafter_dir / "config.json").read_text())
    dc = cfg["dflash_config"]
    taps, group = dc["conv_kernel_size"], dc["conv_group_size"]
    groups = cfg["hidden_size"] // group
    w = {k: v.double() for k, v in load_file(str(drafter_dir / "model.safetensors")).items()}
    tw = {k: v.double() for k, v in load_file(str(target_dir / "model.safetensors")).items()}
    H, Hkv, hd, theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]
    n, L = features.shape[0], block.shape[0]
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = tw["model.embed_tokens.weight"][block] * dc["input_embedding_scale"]
    ctx_pos, blk_pos = torch.arange(n), torch.arange(start, start + L)

    def attention(layer, h):
        p = lambda name: w[f"layers.{layer}.self_attn.{name}"]
        heads = []
        for head in range(H):
            kvh = head // (H // Hkv)
            sl, ksl = slice(head * hd, (head + 1) * hd), slice(kvh * hd, (kvh + 1) * hd)
            q = rope(rms(h @ p("q_proj.weight")[sl].T, p("q_norm.weight")), blk_pos, theta)
            k_ctx = rope(rms(ctx @ p("k_proj.weight")[ksl].T, p("k_norm.weight")), ctx_pos, theta)
            k_blk = rope(rms(h @ p("k_proj.weight")[ksl].T, p("k_norm.weight")), blk_pos, theta)
            v = torch.cat([ctx @ p("v_proj.weight")[ksl].T, h @ p("v_proj.weight")[ksl].T])
            heads.append(torch.softmax(q @ torch.cat([k_ctx, k_blk]).T / math.sqrt(hd), -1) @ v)
        return torch.cat(heads, -1) @ p("o_proj.weight").T

    def mlp(layer, h):
        p = lambda name: w[f"layers.{layer}.mlp.{name}"]
        return (torch.nn.functional.silu(h @ p("gate_proj.weight").T) * (h @ p("up_proj.weight").T)) @ p("down_proj.weight").T

    for layer in range(cfg["num_hidden_layers"]):
        for sub, fn, norm in (("attention_conv", attention, "input_layernorm"),
                              ("mlp_conv", mlp, "post_attention_layernorm")):
            h = rms(x, w[f"layers.{layer}.{norm}.weight"])
            base = w[f"layers.{layer}.{sub}.base_kernel"]
            delta = (h @ w[f"layers.{layer}.{sub}.kernel_projection.weight"].T).view(L, 2, taps, groups)
            y = fn(layer, conv_ref(h, delta[:, 0], base[0], group))
            x = x + conv_ref(y, delta[:, 1], base[1], group)
    hidden = rms(x, w["norm.weight"])[1:]
    z = hidden @ tw["lm_head.weight"].T * dc["output_multiplier"]
    if dc["final_logit_softcapping"]:
        z = torch.tanh(z / dc["final_logit_softcapping"]) * dc["final_logit_softcapping"]

    pred, succ = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
    proj = hidden @ w["candidate_selector.hidden_projection.weight"].T
    k = dc["selector_top_k"]
    lp = torch.log_softmax(z, -1)
    cands, trans = [], []  # per depth: candidate tokens; {predecessor token: [K] log q}
    for d in range(L - 1):
        order = sorted(range(z.shape[1]), key=lambda v: (-z[d, v].item(), v))[:k]
        cands.append(order)
        prevs = [int(block[0])] if d == 0 else cands[d - 1]
        mass = torch.logsumexp(lp[d, order], 0)
        rows = {}
        for p in prevs:
            s = torch.tensor([z[d, c] + (pred[p] * proj[d] * succ[c]).sum() for c in order])
            rows[p] = torch.log_softmax(s, 0) + mass
        trans.append(rows)
    chain, prev = [], int(block[0])
    for d in range(L - 1):
        best = max(range(k), key=lambda j: (trans[d][prev][j].item(), -j))
        prev = cands[d][best]
        chain.append(prev)
    return z, cands, trans, chain


def draft_hidden(target, drafter, prompt, block):
    """The engine's path: prefill the prompt, commit its features as context, draft the block."""
    n = len(prompt)
    out = target(torch.tensor([prompt]), ForwardContext.prefill(target.new_cache(1, 64), [0], n),
                 tuple(drafter.args.target_layer_ids))
    dcache = drafter.new_cache(1, 64)
    ctx = ForwardContext.block(dcache, [0], n)
    drafter.add_context(ctx, out.features)
    dcache.commit(ctx, [n])
    return drafter(target.embed_tokens(torch.tensor([block])), ForwardContext.block(dcache, [0], len(block)))


def ours(target_dir, drafter_dir, prompt, block):
    target = load_target(target_dir, torch.float64, CPU)
    drafter = load_drafter(drafter_dir, target, torch.float64, CPU)
    hidden = draft_hidden(target, drafter, prompt, block)[:, 1:]
    logits = drafter.logits(hidden, target.lm_head)
    cand, trans = drafter.transitions(hidden, logits, torch.tensor(block[:1]))
    return drafter, logits[0], cand[0], trans[0]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("softcap,taps", [(4.0, 3), (None, 1), (2.5, 8)])
def test_dflash2_matches_reference(tmp_path, softcap, taps):
    """Unary logits, candidates (in tie order), every predecessor's conditional log-probs and the
    greedy chain equal the loop-based definition, including taps longer than the block."""
    target_dir = make_target(tmp_path / "t", layers=5)
    drafter_dir = make_dflash2_drafter(tmp_path / "d", target_layers=5, layer_ids=[1, 3], softcap=softcap, taps=taps)
    prompt, block = [3, 9, 4, 11, 5, 7, 2], [8] + [62] * 5
    feats = hf_features(target_dir, prompt, [1, 3]).double()
    with torch.no_grad():
        z, cands, trans, chain = reference_dflash2(drafter_dir, target_dir, feats, torch.tensor(block), len(prompt))
        drafter, logits, cand, tr = ours(target_dir, drafter_dir, prompt, block)
    assert (logits - z).abs().max() < 1e-5
    assert cand.tolist() == cands
    for d in range(len(cands)):
        rows = [0] if d == 0 else range(len(cands[d - 1]))
        for j in rows:
            p = block[0] if d == 0 else cands[d - 1][j]
            assert (tr[d, j] - trans[d][p]).abs().max() < 1e-5, (d, j)
    from flashtree.tree.markov import build_markov_chain

    spec = build_markov_chain(torch.tensor(block[:1]), cand[None], tr[None])
    assert spec.tokens[0, 1:].tolist() == chain


def test_zero_selector_and_identity_convs_are_dflash1(tmp_path):
    """With identity base kernels, zero deltas and codebooks, and unit scales, a DFlash2 checkpoint
    drafts exactly as the DFlash-1 checkpoint holding the same weights: the same hidden states and
    logits, and conditionals that are DFlash-1's marginals on the candidates, whatever the parent."""
    target_dir = make_target(tmp_path / "t", layers=4)
    d2 = make_dflash2_drafter(tmp_path / "d2", target_layers=4, layer_ids=[1, 2], scale=1.0, multiplier=1.0,
                              softcap=None, top_k=7)
    w = load_file(str(d2 / "model.safetensors"))
    for k in w:
        if k.endswith("base_kernel"):
            w[k].zero_()
            w[k][:, 0] = 1.0
        if k.endswith("kernel_projection.weight") or "codebook" in k:
            w[k].zero_()
    save_file(w, str(d2 / "model.safetensors"))
    d1 = tmp_path / "d1"  # the same weights, minus the DFlash2 parts, as a DFlash-1 checkpoint
    d1.mkdir()
    save_file({k: v for k, v in w.items() if "conv" not in k and "selector" not in k}, str(d1 / "model.safetensors"))
    cfg = json.loads((d2 / "config.json").read_text())
    (d1 / "config.json").write_text(json.dumps(cfg | {"architectures": ["DFlashDraftModel"]}))

    prompt, block = [5, 1, 9, 33, 2], [4] + [62] * 5
    with torch.no_grad():
        drafter2, logits2, cand, tr = ours(target_dir, d2, prompt, block)
        drafter1, logits1, _, _ = ours_dflash1(target_dir, d1, prompt, block)
    assert isinstance(drafter2, DFlash2Drafter) and not isinstance(drafter1, DFlash2Drafter)
    torch.testing.assert_close(logits2, logits1, rtol=1e-12, atol=1e-12)
    marginal = torch.log_softmax(logits1, -1).gather(-1, cand)
    torch.testing.assert_close(tr, marginal[:, None, :].expand_as(tr), rtol=1e-12, atol=1e-12)


def ours_dflash1(target_dir, drafter_dir, prompt, block):
    target = load_target(target_dir, torch.float64, CPU)
    drafter = load_drafter(drafter_dir, target, torch.float64, CPU)  # the dispatch loads DFlash-1 too
    hidden = draft_hidden(target, drafter, prompt, block)
    return drafter, target.lm_head(hidden[:, 1:])[0], None, None


def test_config_layout_roundtrip(tmp_path):
    """config.json carries the DFlash2DraftModel keys, reads in transformers, and loads back equal."""
    d = make_dflash2_drafter(tmp_path / "d", target_layers=4, softcap=None)
    raw = json.loads((d / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    dc = raw["dflash_config"]
    assert {k: dc[k] for k in ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")} == \
        {"selector_rank": 6, "selector_top_k": 5, "conv_kernel_size": 3, "conv_group_size": 8}
    assert dc["input_embedding_scale"] == 1.3 and dc["output_multiplier"] == 0.8
    assert dc["final_logit_softcapping"] is None
    cfg = transformers.AutoConfig.from_pretrained(d)
    assert cfg.dflash_config["selector_top_k"] == 5
    names = set(load_file(str(d / "model.safetensors")))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= names
    assert load_file(str(d / "model.safetensors"))["layers.0.mlp_conv.base_kernel"].shape == (2, 3, 32)


def test_bad_dflash2_configs_error(tmp_path):
    target = load_target(make_target(tmp_path / "t", layers=4), torch.float32, CPU)
    d = make_dflash2_drafter(tmp_path / "d", target_layers=4)
    cfg = json.loads((d / "config.json").read_text())
    broken = dict(cfg, dflash_config={k: v for k, v in cfg["dflash_config"].items() if k != "selector_top_k"})
    (d / "config.json").write_text(json.dumps(broken))
    with pytest.raises(FlashtreeError, match="lacks dflash_config.selector_top_k"):
        load_drafter(d, target, torch.float32, CPU)
    cfg["dflash_config"]["conv_group_size"] = 5
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FlashtreeError, match="conv_group_size 5 must divide"):
        load_drafter(d, target, torch.float32, CPU)


def test_top_candidates_settle_ties_by_token_id():
    """Candidates are the top-K by (logit desc, token id asc) even when ties straddle the K-th place."""
    from flashtree.models.dflash2 import top_candidates

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (20, 30), generator=g).float()
    for k in (1, 3, 7, 30):
        vals, ids = top_candidates(x, k)
        for r in range(20):
            want = sorted(range(30), key=lambda v: (-x[r, v].item(), v))[:k]
            assert ids[r].tolist() == want and vals[r].tolist() == x[r, want].tolist()


# ----------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def lossless_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2_lossless")
    target = make_target(root / "target", vocab=16, logit_scale=3.0)
    drafter = make_dflash2_drafter(root / "drafter", target_layers=4, vocab=16, block_size=8, top_k=6, seed=5)
    return target, drafter


@pytest.mark.parametrize("method,budget,selector", [("dflash", 1, None), ("dflash", 1, False), ("ddtree", 1, None),
                                                    ("ddtree", 4, None), ("ddtree", 16, None), ("ddtree", 64, None),
                                                    ("ddtree", 16, False)])
def test_greedy_dflash2_matches_ar(lossless_pair, method, budget, selector):
    """Greedy DFlash (the Markov chain) and DDTree (the Markov tree) with a random DFlash2 drafter,
    batched with one request queued, emit exactly AR's tokens; so does the marginal tree."""
    from test_lossless import PROMPTS, generate

    target, drafter = lossless_pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [generate(target, None, "ar", 1, [p], params, max_batch=1)[0].token_ids for p in PROMPTS]
    llm = LLM(str(target), str(drafter), method=method, budget=budget, device="cpu", dtype="float32", max_batch=3,
              max_model_len=256, use_selector=selector)
    assert llm.engine.runner.use_selector == (selector is None)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ref


@pytest.mark.slow
def test_compiled_dflash2_drafter_matches_ar(lossless_pair):
    """compile=True on the CPU compiles the target's stack and the DFlash2 drafter's layers (its
    block convolutions included): greedy Markov trees under budget="auto" still emit AR's tokens,
    as the eager drafter's do."""
    from test_lossless import PROMPTS, generate

    target, drafter = lossless_pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [generate(target, None, "ar", 1, [p], params, max_batch=1)[0].token_ids for p in PROMPTS]
    llm = LLM(str(target), str(drafter), method="ddtree", device="cpu", dtype="float32", max_batch=3,
              max_model_len=256, compile=True)
    assert llm.engine.runner.drafter.compiled is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref


def test_selector_flag_checks_the_drafter(tmp_path, lossless_pair):
    """use_selector=True with a DFlash-1 drafter is a clear error; --no-selector reaches the engine."""
    from flashtree.cli import build_parser, engine_kwargs
    from tiny import make_drafter

    target, _ = lossless_pair
    d1 = make_drafter(tmp_path / "d1", target_layers=4, vocab=16)
    with pytest.raises(FlashtreeError, match="needs a DFlash2 drafter"):
        LLM(str(target), str(d1), device="cpu", use_selector=True)
    args = build_parser().parse_args(["generate", "x", "--no-selector"])
    assert engine_kwargs(args)["use_selector"] is False


@pytest.mark.slow
@pytest.mark.parametrize("method,budget", [("ddtree", 8), ("dflash", 1)])
def test_dflash2_sampling_matches_target_distribution(tmp_path, method, budget):
    """Sampled DDTree / DFlash output under a DFlash2 draft (candidates: 3 of 4 tokens, so some
    targets' picks fall outside every draft) follows the target's sequence distribution."""
    from test_sampling import PROMPT, SAMPLES, VOCAB, chi_square_p, exact_distribution

    target = make_target(tmp_path / "t", vocab=VOCAB, hidden=32, logit_scale=2.0, seed=3)
    drafter = make_dflash2_drafter(tmp_path / "d", target_layers=4, vocab=VOCAB, block_size=4, top_k=3, seed=4)
    kw = {"temperature": 1.0}
    dist = exact_distribution(target, SamplingParams(**kw))
    llm = LLM(str(target), str(drafter), method=method, budget=budget, device="cpu", dtype="float64",
              max_batch=64, max_model_len=32)
    assert llm.engine.runner.use_selector
    params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **kw) for s in range(SAMPLES)]
    counts = Counter(tuple(o.token_ids) for o in llm.generate([PROMPT] * SAMPLES, params))
    assert chi_square_p(counts, dist) > 1e-3
    wrong = exact_distribution(target, SamplingParams(temperature=1.0, top_k=2))
    assert chi_square_p(counts, {k: v * 0.98 + 0.02 / len(wrong) for k, v in wrong.items()}) < 1e-6  # power


@pytest.mark.parametrize("method,budget", [("dflash", 1), ("ddtree", 16), ("ddtree", "auto")])
def test_a_dflash2_round_reads_the_device_once(tmp_path, monkeypatch, method, budget):
    """The selector's candidates, conditionals and the Markov tree/chain add no host read to a
    round (the CPU-only early stop inside flashtree/tree/ aside, as for build_tree)."""
    from flashtree import EngineConfig, LLMEngine
    from test_host_reads import ReadCounter, reads_per_round

    target = make_target(tmp_path / "t", vocab=32, logit_scale=3.0)
    drafter = make_dflash2_drafter(tmp_path / "d", target_layers=4, vocab=32, block_size=6, top_k=5)
    engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), method=method, budget=budget,
                                    max_budget=16, device="cpu", max_batch=3, max_model_len=96))
    assert engine.runner.use_selector
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request([7, 8], SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True))
    engine.step()
    assert reads_per_round(engine, ReadCounter(monkeypatch), monkeypatch, 3) == [["tolist"]] * 3
