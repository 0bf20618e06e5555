"""MTP heads: the hub checkpoints' `mtp.*` layout, the recursive draft against a float64 reference,
the head cache against a fresh one, and method="mtp" equal to `ar` token for token."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashtree import LLM, FlashtreeError, SamplingParams
from flashtree.config import DEMO_MTP, DEMO_TARGET, EngineConfig
from flashtree.models.context import ForwardContext, SlotBatch
from flashtree.models.loader import checkpoint_layout, hub_state_dict, load_target
from flashtree.models.mtp import SCOPE, build_head, load_head, save_head
from flashtree.models.loader import read_config, text_config
from tests.test_qwen3_5 import SMALL, make_qwen35, randomize
from tests.tiny import add_mtp, make_target, mtp_names

CPU = torch.device("cpu")


def make_next(out, seed: int = 5):
    """A tiny Qwen3-Next checkpoint (packed GDN projections, MoE every other layer)."""
    import transformers

    kw = {**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "shared_expert_intermediate_size": 24, "decoder_sparse_step": 1, "norm_topk_prob": True}
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**kw))
    randomize(hf, seed)
    hf.save_pretrained(out)
    return out


def make_multimodal(out, moe: bool):
    """Qwen3.5 / Qwen3.6 as the hub ships them: the multimodal wrapper (model.language_model.*)."""
    import transformers

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    if moe:
        text = {**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 24}
        text.pop("intermediate_size")
        hf = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(text_config=text,
                                                                                           vision_config=vision))
    else:
        hf = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=SMALL,
                                                                                     vision_config=vision))
    randomize(hf, 3)
    hf.save_pretrained(out)
    return out


LAYOUTS = {  # checkpoint family -> (builder, the MTP layout its hub releases use)
    "qwen3_5": (lambda p: make_multimodal(p, moe=False), "dense"),
    "qwen3_5_moe": (lambda p: make_multimodal(p, moe=True), "fused"),
    "qwen3_next": (make_next, "per_expert"),
}


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_hub_mtp_layouts_load(tmp_path, family):
    """A checkpoint with the hub's exact `mtp.*` names (15 dense, 19 with stacked experts, one per
    expert for Qwen3-Next) loads into the head: every name is one the head's layout asks for, none
    is missing, and every value lands where it belongs (the head written back under the hub's
    names returns the same tensors)."""
    build, kind = LAYOUTS[family]
    path = build(tmp_path / family)
    written = add_mtp(path, kind)
    assert len(written) == {"dense": 15, "fused": 19}.get(kind, 17 + 3 * 4)
    target = load_target(path, torch.float32, CPU)
    head = load_head(path, target, torch.float32, CPU)
    layout = {SCOPE + k for k in checkpoint_layout(head)}
    assert set(written) <= layout
    back = {SCOPE + k: v for k, v in hub_state_dict(head).items()}
    for name, t in written.items():
        if name.endswith("experts.gate_up_proj"):  # stacked: the hub state lists them per expert
            mine = torch.stack([torch.cat([back[name.replace("gate_up_proj", f"{e}.gate_proj.weight")],
                                           back[name.replace("gate_up_proj", f"{e}.up_proj.weight")]])
                                for e in range(t.shape[0])])
        elif name.endswith("experts.down_proj"):
            mine = torch.stack([back[name.replace("down_proj", f"{e}.down_proj.weight")] for e in range(t.shape[0])])
        else:
            mine = back[name]
        assert torch.equal(mine, t), name
    if kind != "fused":  # what we write for these families is exactly what the hub ships
        assert set(back) == set(written)


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("drop", ["mtp.layers.0.self_attn.k_norm.weight", "mtp.pre_fc_norm_hidden.weight"])
def test_missing_mtp_tensor_is_named(tmp_path, drop):
    path = make_multimodal(tmp_path / "t", moe=False)
    add_mtp(path, "dense", drop=drop)
    target = load_target(path, torch.float32, CPU)
    with pytest.raises(FlashtreeError) as e:
        load_head(path, target, torch.float32, CPU)
    assert f"no tensor {drop}" in one_line(e)


def test_misshapen_mtp_tensor_is_named(tmp_path):
    path = make_next(tmp_path / "t")
    add_mtp(path, "per_expert", reshape="mtp.fc.weight")
    target = load_target(path, torch.float32, CPU)
    with pytest.raises(FlashtreeError) as e:
        load_head(path, target, torch.float32, CPU)
    assert "mtp.fc.weight has shape (64, 32), the config implies (32, 64)" in one_line(e)


def test_a_checkpoint_without_mtp_is_refused(tmp_path):
    """method="mtp" on a target that ships no head: one line naming what is missing."""
    path = make_target(tmp_path / "plain")
    with pytest.raises(FlashtreeError) as e:
        LLM(target=str(path), method="mtp", dtype="float32", device="cpu")
    assert "ships no MTP head (no mtp.* tensors such as mtp.fc.weight)" in one_line(e)


def test_config_checks_num_speculative_tokens():
    with pytest.raises(FlashtreeError, match="num_speculative_tokens must be an integer in 1..32"):
        EngineConfig(method="mtp", num_speculative_tokens=0)
    assert EngineConfig(method="mtp").mtp_head == str(DEMO_MTP)  # the demo target's own head


# ---- the recursion, against a float64 reference ------------------------------------------------


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    """x [n, heads, hd] at positions pos [n]: rotate-half RoPE, angles in float32 as HF computes them."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = pos.float()[:, None] * inv
    cos, sin = (torch.cat([ang, ang], -1).cos().double()[:, None], torch.cat([ang, ang], -1).sin().double()[:, None])
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_layer(w: dict, x, pos, c, keys: list, values: list):
    """One Qwen3 decoder layer over entries x [n, d] at positions pos; appends their K/V to
    keys/values and attends causally over everything appended so far."""
    eps, nh, nkv, hd = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    h = rms(x, w["layers.0.input_layernorm.weight"], eps)
    q = (h @ w["layers.0.self_attn.q_proj.weight"].T).view(-1, nh, hd)
    k = (h @ w["layers.0.self_attn.k_proj.weight"].T).view(-1, nkv, hd)
    v = (h @ w["layers.0.self_attn.v_proj.weight"].T).view(-1, nkv, hd)
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or c.rope_theta
    q = rope(rms(q, w["layers.0.self_attn.q_norm.weight"], eps), pos, theta)
    k = rope(rms(k, w["layers.0.self_attn.k_norm.weight"], eps), pos, theta)
    keys.append(k)
    values.append(v)
    K, V = torch.cat(keys), torch.cat(values)
    start = K.shape[0] - x.shape[0]
    out = torch.zeros_like(q)
    for i in range(x.shape[0]):
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = (K[: start + i + 1, kv] @ q[i, head]) / math.sqrt(hd)
            out[i, head] = scores.softmax(0) @ V[: start + i + 1, kv]
    x = x + out.reshape(x.shape[0], -1) @ w["layers.0.self_attn.o_proj.weight"].T
    h = rms(x, w["layers.0.post_attention_layernorm.weight"], eps)
    gate, up = h @ w["layers.0.mlp.gate_proj.weight"].T, h @ w["layers.0.mlp.up_proj.weight"].T
    return x + (F.silu(gate) * up) @ w["layers.0.mlp.down_proj.weight"].T


def reference_draft(w: dict, c, embed, lm_head, hidden, prompt: list[int], root: int, k: int):
    """The head's draft, written out: entries (h_i, x_{i+1}) for the prompt (the last one paired
    with the root), then each step fed the PREVIOUS STEP'S OWN output and drafted token."""
    def head(tokens, hid, pos, keys, values):
        e = rms(embed[tokens], w["pre_fc_norm_embedding.weight"], c.rms_norm_eps)
        h = rms(hid, w["pre_fc_norm_hidden.weight"], c.rms_norm_eps)
        x = torch.cat([e, h], -1) @ w["fc.weight"].T
        return rms(reference_layer(w, x, pos, c, keys, values), w["norm.weight"], c.rms_norm_eps)

    keys, values = [], []
    n = len(prompt)
    out = head(torch.tensor(prompt[1:] + [root]), hidden[:n], torch.arange(n), keys, values)
    g, outputs, drafts = out[-1:], [out[-1]], []
    for step in range(k):
        token = int((g @ lm_head.T).argmax())
        drafts.append(token)
        if step + 1 < k:
            g = head(torch.tensor([token]), g, torch.tensor([n + step]), keys, values)  # own output, own token
            outputs.append(g[0])
    return drafts, torch.stack(outputs)


def prefilled(tmp_path, prompt: list[int], k: int, seed: int):
    """A tiny float64 Qwen3 target with a random head saved beside it, an mtp engine over them, and
    a request whose prompt is prefilled (the head holds entries 0..n-2; its first token is the
    root): (llm, head, request, target dir)."""
    path = make_target(tmp_path / "t", seed=seed, logit_scale=3.0)
    torch.manual_seed(seed + 1)
    head = build_head(text_config(read_config(path))).double()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    save_head(head, tmp_path / "head", path)
    llm = LLM(target=str(path), method="mtp", mtp_head=str(tmp_path / "head"), num_speculative_tokens=k,
              dtype="float64", device="cpu", max_batch=1)
    req = llm.engine.add_request(prompt, SamplingParams(max_tokens=1))
    llm.engine.step()
    return llm, head, req, path


def test_recursive_draft_matches_float64_reference(tmp_path):
    """The engine's k-step draft (tokens and every step's head output) equals a plain float64
    reimplementation in which step j reads step j-1's own output and drafted token: the head's
    pending-entry window, its cache and its positions follow the recursion exactly."""
    import transformers

    prompt = [3, 17, 40, 8, 22, 5, 9]
    llm, head, req, path = prefilled(tmp_path, prompt, k=4, seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    runner = llm.engine.runner
    root = req.output_ids[0]
    seen = []
    runner.mtp.head.register_forward_hook(lambda _m, _i, out: seen.append(out[0, -1]))
    with torch.no_grad():
        spec = runner.mtp.draft(SlotBatch.of(runner.cache, [req.slot]), torch.tensor([root]))
        # What the head reads is the target's final hidden state after its final norm (HF's
        # last_hidden_state; equal up to float32 RoPE angles, computed in another order there).
        hidden = runner.mtp.hidden[req.slot, : len(prompt)]
        assert torch.allclose(hidden, hf.model(torch.tensor([prompt])).last_hidden_state[0], atol=1e-5)
    w = {k: v.double() for k, v in hub_state_dict(head).items()}
    drafts, outputs = reference_draft(w, hf.config, hf.model.embed_tokens.weight, hf.lm_head.weight, hidden, prompt,
                                      root, 4)
    assert spec.tokens[0].tolist() == [root] + drafts
    assert torch.allclose(torch.stack(seen), outputs, atol=1e-9)


# ---- the engine: lossless, batched, prefix reuse, TP ---------------------------------------------


def committed_cache_is_fresh(llm, slot: int, sequence: list[int]) -> None:
    """The head's committed entries equal those of a fresh head cache built over the same committed
    tokens in one window (as `ar` builds the target's)."""
    runner = llm.engine.runner
    mtp, target = runner.mtp, runner.target
    c = mtp.cache.lengths[slot]
    assert c >= len(sequence) - mtp.k - 1
    with torch.no_grad():
        cache = target.new_cache(1, len(sequence) + 1)
        out = target(torch.tensor([sequence]), ForwardContext.prefill(cache, [0], len(sequence)), mtp.feature_layers)
        fresh = mtp.head.new_cache(1, c + 1)
        ctx = ForwardContext.prefill(fresh, [0], c)
        mtp.head(target.embed_tokens(torch.tensor([sequence[1 : c + 1]])), target.norm(out.features[:, :c]), ctx)
    assert torch.allclose(fresh.k[0, 0, :c], mtp.cache.k[0, slot, :c], atol=1e-10)
    assert torch.allclose(fresh.v[0, 0, :c], mtp.cache.v[0, slot, :c], atol=1e-10)


def check_lossless(common: dict, prompts: list, ks=(1, 3, 5)) -> int:
    """mtp at every k equals ar, greedy and seeded sampling; returns the longest round's tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = [SamplingParams(temperature=t, top_p=p, max_tokens=24, ignore_eos=True, seed=i)
               for i, (t, p) in enumerate([(0.7, 1.0), (1.0, 0.9), (0.7, 1.0), (1.0, 1.0)][: len(prompts)])]
    ar = LLM(method="ar", **common)
    ref = {name: [o.token_ids for o in ar.generate(prompts, p)] for name, p in (("greedy", greedy), ("sampled", sampled))}
    longest = 0
    for k in ks:
        llm = LLM(method="mtp", num_speculative_tokens=k, **common)
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            outs = llm.generate(prompts, params)
            assert [o.token_ids for o in outs] == ref[name], (k, name)
            longest = max(longest, max(max(o.stats.accept_lengths) for o in outs))
    return longest


def test_demo_head_is_lossless_batched():
    """The demo pair's trained head: k = 1, 3, 5, four prompts through two slots (continuous
    batching), greedy and seeded sampling equal `ar`; drafts are accepted."""
    common = dict(dtype="float32", device="cpu", max_batch=2, prefix_cache=False)
    prompts = ["def fibonacci(n):", "The history of the", "import os\nimport sys\n", "class Stack:\n    def"]
    assert check_lossless(common, prompts) > 2


def test_static_shapes_pad_mtp_rounds():
    """With static shapes (compile's buckets) three requests run as four rows, the fourth on the
    dummy slot, and mtp still emits `ar`'s tokens."""
    prompts = ["def fibonacci(n):", "The history of the", "import os\n"]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", max_batch=3, prefix_cache=False)
    ar = [o.token_ids for o in LLM(method="ar", **common).generate(prompts, params)]
    outs = LLM(method="mtp", static_shapes=True, **common).generate(prompts, params)
    assert [o.token_ids for o in outs] == ar


def check_captured(common: dict, prompts: list, k: int = 3) -> None:
    """capture=True captures mtp's rounds (one per batch and key bucket) and replays them through
    static buffers: greedy and seeded sampling still give `ar`'s tokens, and every round accepts
    what the uncaptured engine's accepts (the same drafts: the head's pending entries kept in the
    replayed commit), in float64, where padding cannot flip a draft."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3)
    ar = LLM(method="ar", **common)
    eager = LLM(method="mtp", num_speculative_tokens=k, **common)
    llm = LLM(method="mtp", num_speculative_tokens=k, capture=True, **common)
    assert llm.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    for params in (greedy, sampled):
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ar.generate(prompts, params)]
        assert [o.stats.accept_lengths for o in outs] == [o.stats.accept_lengths for o in eager.generate(prompts, params)]
        assert max(max(o.stats.accept_lengths) for o in outs) > 1


def test_captured_mtp_rounds_equal_ar():
    """The demo head's rounds, captured and replayed, four prompts through three slots (batches
    padded to buckets of 1, 2 and 4 rows): `ar`'s tokens."""
    common = dict(dtype="float64", device="cpu", max_batch=3, max_model_len=192, prefix_cache=False)
    check_captured(common, ["def fibonacci(n):", "The history of the", "import os\nimport sys\n", "class Stack:"])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3.5 target whose checkpoint ships an MTP head trained on its own greedy text
    (the head is written into the target's checkpoint under `mtp.*`, as the hub ships it)."""
    from flashtree.train.mtp import MTPTrainConfig, train_mtp
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("mtp_hybrid")
    target, _ = make_qwen35(root / "target", seed=11, logit_scale=4.0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 62, (int(n),), generator=gen).tolist() for n in torch.randint(2, 12, (48,), generator=gen)]
    ar = LLM(target=str(target), method="ar", dtype="float32", device="cpu", max_batch=8, max_model_len=128)
    outs = ar.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    rows = "".join(f'{{"id": "{i}", "prompt_ids": {p}, "response_ids": {o.token_ids}}}\n'
                   for i, (p, o) in enumerate(zip(prompts, outs)))
    (root / "seqs.jsonl").write_text(rows)
    train_mtp(MTPTrainConfig(out=str(root / "head"), sequences=str(root / "seqs.jsonl"), target=str(target),
                             steps=60, batch_size=8, lr=3e-3, warmup=0.1, dtype="float32", log_every=1000))
    head = load_file(str(root / "head" / "model.safetensors"))
    save_file(head, str(target / "mtp.safetensors"), metadata={"format": "pt"})
    return str(target)


def test_hybrid_target_mtp_is_lossless(hybrid):
    """A hybrid (Gated DeltaNet) target with its own mtp.* head: mtp at k = 1, 3, 5 equals `ar`,
    greedy and seeded sampling, four prompts through three slots; drafts are accepted."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 62, (n,), generator=gen).tolist() for n in (3, 17, 40, 8)]
    common = dict(target=hybrid, dtype="float32", device="cpu", max_batch=3, max_model_len=128)
    assert check_lossless(common, prompts) > 2


def test_hybrid_target_captured_mtp_is_lossless(hybrid):
    """Captured mtp rounds on a hybrid target: the recurrent state's commit and the head's pending
    entries go through the replayed pieces, and the tokens are still `ar`'s."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 62, (n,), generator=gen).tolist() for n in (3, 17, 40, 8)]
    check_captured(dict(target=hybrid, dtype="float64", device="cpu", max_batch=3, max_model_len=128), prompts)


def test_head_cache_equals_a_fresh_one_after_rounds(hybrid):
    """After rounds of partial acceptance, the head's committed K/V equals a fresh head's over the
    committed tokens: pending entries are computed once, with the target's true hidden states."""
    llm = LLM(target=hybrid, method="mtp", num_speculative_tokens=3, dtype="float64", device="cpu", max_batch=1,
              max_model_len=128)
    prompt = [7, 3, 19, 22, 40, 1]
    req = llm.engine.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    while not req.finished:
        llm.engine.step()
    assert max(req.stats.accept_lengths) > 1 and min(req.stats.accept_lengths) < 4
    committed = prompt + req.output_ids[:-1]  # the last token is a bonus, not yet in the cache
    committed_cache_is_fresh(llm, req.slot, committed)


def test_prefix_reuse_keeps_mtp_exact(hybrid):
    """Prompts sharing a long prefix reuse it (the head's entries and hidden states copied with the
    target's K/V and recurrent state) and still emit exactly `ar`'s tokens."""
    base = [5, 9, 2, 33, 7, 1, 14, 8, 21, 3, 30, 11, 4, 17, 6, 25, 12, 2, 9, 40]
    prompts = [base + [3], base + [3], base + [45, 6], base[:10]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    common = dict(target=hybrid, dtype="float32", device="cpu", max_batch=1, max_model_len=128)
    ar = [o.token_ids for o in LLM(method="ar", prefix_cache=False, **common).generate(prompts, params)]
    outs = LLM(method="mtp", **common).generate(prompts, params)
    assert [o.token_ids for o in outs] == ar
    assert sum(o.stats.cached_tokens for o in outs) > 0


@pytest.mark.slow
def test_two_ranks_draft_what_one_does(hybrid, tmp_path, monkeypatch):
    """Tensor parallelism: the head is split like the target's layers, and mtp with
    tensor_parallel_size=2 emits the tokens of 1 (greedy and sampled, batched), with both ranks'
    results and cache lengths equal after every call (FLASHTREE_TP_CHECK)."""
    monkeypatch.setenv("FLASHTREE_TP_CHECK", "1")
    import flashtree.parallel.workers as workers

    if workers._cluster is not None and not workers._cluster.check_results:
        workers._cluster.close()
    dense = make_target(tmp_path / "dense", seed=3, logit_scale=4.0)
    torch.manual_seed(2)
    head = build_head(text_config(read_config(dense)))
    save_head(head, tmp_path / "head", dense)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 62, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    params = [SamplingParams(temperature=t, max_tokens=16, ignore_eos=True, seed=i) for i, t in enumerate((0.0, 1.0, 0.7))]
    for target, mtp_head in ((hybrid, None), (str(dense), str(tmp_path / "head"))):
        out = {}
        for tp in (1, 2):
            llm = LLM(target=target, method="mtp", mtp_head=mtp_head, tensor_parallel_size=tp, device="cpu",
                      dtype="float64", max_batch=2, max_model_len=96)
            out[tp] = [o.token_ids for o in llm.generate(prompts, params)]
        assert out[2] == out[1], target


# ---- training reads what the engine drafts --------------------------------------------------------


def test_step_inputs_and_labels_line_up():
    """With token == 100 + position, step s at entry t reads token 100 + t + s and is labelled
    100 + t + s + 1, counted only on response tokens inside the sequence."""
    from flashtree.train.mtp import step_inputs

    ids = 100 + torch.arange(10)[None]
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    for s in (1, 2, 3):
        tokens, labels, valid = step_inputs(ids, mask, s, depth=3)
        t = torch.arange(9)
        inside = t + s + 1 <= 9
        assert torch.equal(tokens[0][t + s <= 9], (100 + t + s)[t + s <= 9])
        assert torch.equal(labels[0][inside], (100 + t + s + 1)[inside])
        assert torch.equal(valid[0], inside & (t + s + 1 >= 3))


def test_training_steps_equal_the_engine_draft(tmp_path):
    """Training's step-s output at the prompt's last entry equals the engine's draft step s, when
    the sequence continues with the engine's own drafts: training sees exactly what drafting does
    (the true context's entries, then the chain's own earlier steps)."""
    from flashtree.train.mtp import step_outputs

    prompt = [9, 4, 31, 2, 17, 50, 6, 6, 12]
    llm, _, req, _ = prefilled(tmp_path, prompt, k=3, seed=6)
    runner = llm.engine.runner
    seen = []
    runner.mtp.head.register_forward_hook(lambda _m, _i, out: seen.append(out[0, -1]))
    with torch.no_grad():
        spec = runner.mtp.draft(SlotBatch.of(runner.cache, [req.slot]), torch.tensor(req.output_ids))
        seq = torch.tensor([prompt + spec.tokens[0].tolist()])
        cache = runner.target.new_cache(1, seq.shape[1])
        feats = runner.target(seq, ForwardContext.prefill(cache, [0], seq.shape[1]), runner.mtp.feature_layers).features
        outs = step_outputs(runner.mtp.head, runner.target.embed_tokens, seq, runner.target.norm(feats), depth=3)
    t = len(prompt) - 1
    for s in range(3):
        assert torch.allclose(outs[s][0, t], seen[s], atol=1e-10), s


def test_mtp_training_resumes_and_loads(tmp_path):
    """A run killed after some steps resumes to the same head as an uninterrupted run, and the
    output directory is a head `LLM(method="mtp")` loads."""
    from flashtree.train.mtp import MTPTrainConfig, train_mtp

    path = make_target(tmp_path / "t", seed=2, logit_scale=3.0)
    rows = "".join(f'{{"prompt_ids": [{i}, {i + 1}], "response_ids": {[(i * 7 + j) % 60 for j in range(12)]}}}\n'
                   for i in range(12))
    (tmp_path / "s.jsonl").write_text(rows)
    common = dict(sequences=str(tmp_path / "s.jsonl"), target=str(path), steps=6, batch_size=4, dtype="float32",
                  depth=2, log_every=2, save_every=2)
    train_mtp(MTPTrainConfig(out=str(tmp_path / "a"), **common))
    train_mtp(MTPTrainConfig(out=str(tmp_path / "b"), stop_after=3, **common))
    train_mtp(MTPTrainConfig(out=str(tmp_path / "b"), **common))
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert set(a) == set(mtp_names("dense"))  # a Qwen3 target's head: the names Qwen3.5's dense heads ship
    out = LLM(target=str(path), method="mtp", mtp_head=str(tmp_path / "a"), dtype="float32",
              device="cpu").generate([[1, 2, 3]], SamplingParams(max_tokens=8))
    assert len(out[0].token_ids) == 8


def test_demo_head_ships_with_its_recipe():
    """The demo pair's MTP head is an asset like the drafters: config, weights and recipe."""
    import json

    for name in ("config.json", "model.safetensors", "recipe.json"):
        assert (DEMO_MTP / name).is_file(), name
    recipe = json.loads((DEMO_MTP / "recipe.json").read_text())
    assert "commands" in recipe and recipe["train"]["steps"] > 0
    target = load_target(DEMO_TARGET, torch.float32, CPU)
    load_head(DEMO_MTP, target, torch.float32, CPU)


# ---- the command line ---------------------------------------------------------------------------


def test_generate_and_bench_run_mtp_on_the_demo_pair(tmp_path, capsys):
    """`flashtree generate --method mtp` and `flashtree bench --methods ar,mtp,dflash,ddtree` run the
    demo pair's head offline; the bench's mtp cells (one per k) match ar at T = 0."""
    import json

    from flashtree.cli import main

    assert main(["generate", "def add(a, b):", "--method", "mtp", "--num-speculative-tokens", "2",
                 "--max-tokens", "8", "--threads", "1"]) == 0
    assert "[mtp] tokens=8" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def mean(xs):", "The river")))
    out = tmp_path / "bench"
    assert main(["bench", "--methods", "ar,mtp,dflash,ddtree", "--budgets", "8", "--num-speculative-tokens", "1,3",
                 "--suites", str(prompts), "--num-prompts", "2", "--max-tokens", "12", "--temperatures", "0",
                 "--cost-repeats", "1", "--no-plots", "--threads", "1", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert [c["label"] for c in data["cells"]] == ["ar", "mtp-1", "mtp-3", "dflash", "ddtree-8"]
    assert all(c["matches_ar"] == 1.0 for c in data["cells"] if c["method"] != "ar")
    assert [c["tree_nodes"] for c in data["cells"] if c["method"] == "mtp"] == [2, 4]
    assert data["models"]["mtp_head"]["path"].endswith("mtp")


def test_missing_mtp_head_dir_is_one_line(capsys):
    from flashtree.cli import main

    assert main(["generate", "hi", "--method", "mtp", "--mtp-head", "/nonexistent/head"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such model directory: /nonexistent/head (given as --mtp-head)" in err


def test_serve_runs_mtp():
    """The OpenAI server on an mtp engine: a seeded sampled completion equals `ar`'s, and the
    startup line names the head and k."""
    import httpx

    from flashtree.engine import LLMEngine
    from flashtree.server import BackgroundServer, build_app
    from flashtree.server.cli import startup_line

    body = {"model": "flashtree-demo", "prompt": "def area(r):", "max_tokens": 16, "temperature": 0.7, "seed": 4}
    texts = {}
    for method in ("ar", "mtp"):
        engine = LLMEngine(EngineConfig(method=method, device="cpu", dtype="float32", max_batch=2))
        with BackgroundServer(build_app(engine, model_name="flashtree-demo")) as url:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        texts[method] = r.json()["choices"][0]["text"]
        if method == "mtp":
            line = startup_line(engine, "flashtree-demo", url)
            assert "method=mtp" in line and f"drafter={DEMO_MTP} k=3" in line
    assert texts["mtp"] == texts["ar"]
