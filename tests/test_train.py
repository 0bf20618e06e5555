"""Drafter training pipeline: the block mask, label alignment, resumable stages, a learnable
task through the real engine, and DDP under torchrun. Everything here is tiny and synthetic."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.models.context import ForwardContext
from flashtree.models.dflash import DFlashArgs, DFlashDrafter
from flashtree.models.dflash2 import DFlash2Args, DFlash2Drafter, load_drafter
from flashtree.models.loader import load_target
from flashtree.train.blocks import (
    IGNORE,
    BlockDrafter,
    anchor_candidates,
    block_labels,
    block_loss,
    block_prev_tokens,
    block_tokens,
    make_batch,
    sample_anchors,
    slot_weights,
)
from flashtree.train.features import ExtractConfig, FeatureRow, FeatureShards, extract
from flashtree.train.responses import RegenerateConfig, regenerate
from flashtree.train.tau import EvalConfig, evaluate
from flashtree.train.trainer import TrainConfig, train

from tiny import make_drafter, make_target

PERIOD, VOCAB, MASK = 32, 40, 39
CPU_BACKENDS = ["split", "dense"]


# ----------------------------------------------------------------------------- helpers


def random_drafter(block_size: int = 4, window: int | None = None, seed: int = 0, kind: str = "dflash") -> DFlashDrafter:
    """A random drafter; kind "dflash2" adds random convolutions and selector (taps past the block)."""
    torch.manual_seed(seed)
    types = ["sliding_attention" if window else "full_attention"] * 2
    shape = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                 rms_norm_eps=1e-6, block_size=block_size, target_layer_ids=[0, 2], mask_token_id=5,
                 num_target_layers=4, vocab_size=64, layer_types=types, sliding_window=window)
    if kind == "dflash2":
        args = DFlash2Args(**shape, selector_rank=4, selector_top_k=6, conv_kernel_size=3, conv_group_size=8,
                           input_embedding_scale=1.5, output_multiplier=0.7, final_logit_softcapping=5.0)
        drafter = DFlash2Drafter(args).double()
    else:
        drafter = DFlashDrafter(DFlashArgs(**shape)).double()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    return drafter


def make_counting_target(out: Path, hidden: int = 32, scale: float = 6.0) -> Path:
    """A Qwen3 whose greedy continuation counts t -> t+1 (mod 32); tokens 32..39 never win.

    Its layers add nothing (zero output projections), the embeddings of 0..31 are orthogonal,
    and the LM head row of t+1 is the embedding of t: a deterministic target by construction.
    """
    import transformers

    g = torch.Generator().manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=hidden // 4, max_position_embeddings=512, tie_word_embeddings=False,
                                   eos_token_id=MASK, rms_norm_eps=1e-6)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 if p.dim() > 1 else torch.ones_like(p))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        q, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=g))
        emb = torch.randn(VOCAB, hidden, generator=g)
        emb[:PERIOD] = q[:PERIOD] * hidden**0.5
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.zeros(VOCAB, hidden)
        for t in range(PERIOD):
            head[(t + 1) % PERIOD] = scale * q[t]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out)
    return out


def write_prompts(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        s, k = rng.randrange(PERIOD), rng.randrange(2, 6)
        rows.append({"id": f"p{i}", "prompt_ids": [(s + j) % PERIOD for j in range(k)]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """Counting target + its regenerated responses + extracted features (shared, built once)."""
    root = tmp_path_factory.mktemp("counting")
    target = make_counting_target(root / "target")
    prompts = write_prompts(root / "prompts.jsonl", 48, seed=0)
    responses = root / "responses.jsonl"
    regenerate(RegenerateConfig(prompts=str(prompts), out=str(responses), target=str(target), method="ar",
                                max_tokens=40, chunk=16, dtype="float32"))
    features = root / "features"
    extract(ExtractConfig(data=str(responses), out=str(features), target=str(target), layer_ids=[0, 1],
                          shard_size=16, store_dtype="float32", dtype="float32"))
    return {"root": root, "target": target, "prompts": prompts, "responses": responses, "features": features}


# ----------------------------------------------------------------------------- the block mask


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("backend", CPU_BACKENDS + ["flex"])
@pytest.mark.parametrize("window", [None, 3])
def test_block_sees_only_context_before_its_anchor_and_itself(backend: str, window: int | None, kind: str) -> None:
    drafter = random_drafter(window=window, kind=kind)
    model = BlockDrafter(drafter, backend)
    t, b = 14, 4
    anchors = torch.tensor([[1, 4, 5, 9]])
    feats = torch.randn(1, t, 64, dtype=torch.double)
    noise = torch.randn(1, 4, b, 32, dtype=torch.double)
    with torch.no_grad():
        try:
            base = model(feats, noise, anchors)
        except Exception as e:  # FlexAttention missing or unsupported on this build
            if backend == "flex":
                pytest.skip(f"flex_attention unavailable here: {type(e).__name__}")
            raise
        for j, a in enumerate(anchors[0].tolist()):
            for p in range(t):
                f = feats.clone()
                f[0, p] += 1.0
                out = model(f, noise, anchors)[0, j]
                changed = not torch.equal(out, base[0, j])
                in_window = window is None or a - p < window  # slot 0 (position a) sees the most
                assert changed == (p < a and in_window), (a, p)
            for other in range(4):
                n = noise.clone()
                n[0, other, 1] += 1.0
                changed = not torch.equal(model(feats, n, anchors)[0, j], base[0, j])
                assert changed == (other == j), (j, other)  # own block: bidirectional; others: never


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_backends_agree(kind: str) -> None:
    drafter = random_drafter(kind=kind)
    feats = torch.randn(2, 11, 64, dtype=torch.double)
    noise = torch.randn(2, 3, 4, 32, dtype=torch.double)
    anchors = torch.tensor([[1, 2, 7], [3, 0, 0]])
    outs = [BlockDrafter(drafter, be)(feats, noise, anchors) for be in CPU_BACKENDS]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("anchors", [[6], [1, 3, 4, 8, 11]])
def test_training_forward_matches_inference_drafter(tmp_path: Path, anchors: list[int], kind: str) -> None:
    """Logits of every block = the engine's drafter logits after committing `a` tokens (DFlash2:
    its convolutions run per block, its embedding scale applies)."""
    from test_dflash2 import make_dflash2_drafter

    target = load_target(make_target(tmp_path / "t", layers=4), torch.float64, torch.device("cpu"))
    make = make_drafter if kind == "dflash" else make_dflash2_drafter
    drafter = load_drafter(make(tmp_path / "d", 4, block_size=4, layer_ids=[1, 2]), target,
                           torch.float64, torch.device("cpu"))
    ids = torch.randint(0, 60, (1, 14))
    cache = target.new_cache(1, 14)
    feats = target(ids, ForwardContext.prefill(cache, [0], 14), (1, 2)).features
    anc = torch.tensor([anchors])
    tokens = block_tokens(ids, anc, 4, drafter.args.mask_token_id)
    with torch.no_grad():
        hidden = BlockDrafter(drafter)(feats, target.embed_tokens(tokens), anc)
        for j, a in enumerate(anchors):
            dcache = drafter.new_cache(1, 32)
            ctx = ForwardContext.block(dcache, [0], a)
            drafter.add_context(ctx, feats[:, :a])
            dcache.commit(ctx, [a])
            ref = drafter(target.embed_tokens(tokens[:, j]), ForwardContext.block(dcache, [0], tokens.shape[-1]))
            torch.testing.assert_close(target.lm_head(hidden[:, j, 1:]), target.lm_head(ref[:, 1:]),
                                       rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- labels


def test_slot_k_is_labelled_with_the_token_at_anchor_plus_k() -> None:
    t, b, prompt = 20, 5, 6
    ids = torch.arange(100, 100 + t)  # token = 100 + position: any shift shows
    mask = torch.arange(t) >= prompt
    mask[14] = False  # a non-response token inside the response (e.g. a tool turn)
    row = FeatureRow(ids, mask, None)
    batch = make_batch([row], max_anchors=100)
    anchors = batch.anchors[0].tolist()
    assert anchors == [a for a in range(prompt, t - 1) if mask[a] and mask[a + 1]]
    labels = block_labels(batch, b)[0]
    tokens = block_tokens(batch.input_ids, batch.anchors, b, mask_token_id=7)[0]
    for j, a in enumerate(anchors):
        assert tokens[j, 0] == 100 + a and (tokens[j, 1:] == 7).all()
        for k in range(1, b):
            want = 100 + a + k if a + k < t and mask[a + k] else IGNORE
            assert labels[j, k - 1] == want, (a, k)


def test_selector_predecessor_is_the_true_token_before_each_slot() -> None:
    """Slot k's predecessor is the token at anchor + k - 1 (the anchor itself at slot 1), i.e. the
    label of slot k - 1: teacher forcing, shifted by exactly one."""
    t, b = 20, 5
    ids = torch.arange(100, 100 + t)[None]
    anchors = torch.tensor([[3, 7, 16]])
    prev = block_prev_tokens(ids, anchors, b)[0]
    batch = make_batch([FeatureRow(ids[0], torch.ones(t, dtype=torch.bool), None)], max_anchors=100)
    labels = block_labels(batch, b)[0]
    for j, a in enumerate(anchors[0].tolist()):
        assert prev[j].tolist()[: t - a] == [100 + a + k - 1 for k in range(1, b)][: t - a]
        row = batch.anchors[0].tolist().index(a)
        assert prev[j, 1:].tolist()[: t - a - 2] == labels[row, :-1].tolist()[: t - a - 2]


def test_pairwise_term_sees_only_the_previous_token_and_the_hidden_state() -> None:
    """The selector's training scores at slot k do not change when the label at slot k or any later
    token changes, and do change with the token before it (the check has power)."""
    drafter = random_drafter(block_size=5, kind="dflash2")
    model = BlockDrafter(drafter, "split")
    g = torch.Generator().manual_seed(0)
    t, b = 16, 5
    ids = torch.randint(0, 60, (1, t), generator=g)
    feats = torch.randn(1, t, 64, generator=g, dtype=torch.double)
    anchors = torch.tensor([[2, 6, 9]])
    embed = torch.nn.Embedding(64, 32).double()

    def pairwise(tokens: torch.Tensor) -> torch.Tensor:
        block = block_tokens(tokens, anchors, b, drafter.args.mask_token_id)
        hidden = model(feats, embed(block), anchors)[:, :, 1:]
        prev = block_prev_tokens(tokens, anchors, b)
        return drafter.candidate_selector.full(hidden, prev)  # [1, m, B-1, V]

    with torch.no_grad():
        base = pairwise(ids)
        for j, a in enumerate(anchors[0].tolist()):
            for k in range(1, b):
                later = ids.clone()
                later[0, a + k:] = (later[0, a + k:] + 7) % 60  # the label of slot k and everything after
                torch.testing.assert_close(pairwise(later)[0, j, k - 1], base[0, j, k - 1], rtol=0, atol=0)
                before = ids.clone()
                before[0, a + k - 1] = (before[0, a + k - 1] + 7) % 60  # the true previous token
                assert not torch.equal(pairwise(before)[0, j, k - 1], base[0, j, k - 1]), (a, k)


def test_selector_loss_and_chain_hits() -> None:
    """DFlash2's loss is the unary CE plus the selector CE, and its chain hits are the selector's:
    with flat unary logits (top-K = ids 0..K-1, argmax 0) and a selector that favours token 3,
    every slot labelled 3 is a hit for DFlash2 and a miss for the marginal argmax."""
    drafter = random_drafter(block_size=4, kind="dflash2")
    lm_head = torch.nn.Linear(32, 64, bias=False).double()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 2, 4, 32, generator=g, dtype=torch.double)
    labels = torch.randint(0, 64, (1, 2, 3), generator=g)
    prev = torch.randint(0, 64, (1, 2, 3), generator=g)
    w = slot_weights(4).double()
    res = block_loss(hidden, labels, lm_head, w, drafter, prev)
    assert res.loss.item() == pytest.approx(res.unary_loss + res.selector_loss) and res.selector_loss > 0
    assert block_loss(hidden, labels, lm_head, w).selector_loss == 0.0

    sel = drafter.candidate_selector
    with torch.no_grad():
        lm_head.weight.zero_()
        sel.predecessor_codebook.fill_(1.0)
        sel.hidden_projection.weight.zero_()
        sel.hidden_projection.weight[0] = 1 / 32
        sel.successor_codebook.zero_()
        sel.successor_codebook[3, 0] = 10.0
    hidden = torch.ones(1, 2, 4, 32, dtype=torch.double)
    labels = torch.full((1, 2, 3), 3)
    assert block_loss(hidden, labels, lm_head, w, drafter, prev).accept_sum == 2 * 4  # 1 + 3 hits per block
    assert block_loss(hidden, labels, lm_head, w).accept_sum == 2 * 1
    sel.successor_codebook.data[3, 0] = 0.0
    sel.successor_codebook.data[7, 0] = 10.0  # favours a token outside the top-K: never drafted
    assert block_loss(hidden, torch.full((1, 2, 3), 7), lm_head, w, drafter, prev).accept_sum == 2 * 1


def test_anchors_are_random_response_positions_capped_and_sorted() -> None:
    mask = torch.tensor([0] * 10 + [1] * 50, dtype=torch.bool)
    cand = set(anchor_candidates(mask).tolist())
    assert cand == set(range(10, 59))
    draws = [sample_anchors(mask, 8, torch.Generator().manual_seed(s)) for s in range(5)]
    for d in draws:
        assert len(d) == 8 and set(d.tolist()) <= cand and d.tolist() == sorted(set(d.tolist()))
    assert len({tuple(d.tolist()) for d in draws}) > 1  # redrawn per step


def test_slot_weights() -> None:
    w = slot_weights(16)
    assert w.shape == (15,) and w[0] == 1.0
    torch.testing.assert_close(w[7], torch.exp(torch.tensor(-1.0)))  # gamma = 7 for B = 16
    torch.testing.assert_close(slot_weights(8)[1], torch.exp(torch.tensor(-1 / 3.5)))  # scaled with B


# ----------------------------------------------------------------------------- resumable stages


def test_regenerate_resumes_without_duplicates(counting, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    kw = dict(prompts=str(counting["prompts"]), out=str(out), target=str(counting["target"]), method="ar",
              max_tokens=40, chunk=16, dtype="float32")
    regenerate(RegenerateConfig(limit=20, **kw))
    with open(out, "a") as f:
        f.write('{"id": "p20", "prompt_')  # a torn line, as a kill leaves it
    stats = regenerate(RegenerateConfig(**kw))
    assert stats["skipped"] == 20 and stats["written"] == 28
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    full = [json.loads(x) for x in counting["responses"].read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in full]
    assert [r["response_ids"] for r in rows] == [r["response_ids"] for r in full]
    first = rows[0]
    assert first["response_ids"][0] == (first["prompt_ids"][-1] + 1) % PERIOD


def test_killed_extraction_resumes_to_identical_shards(counting, tmp_path: Path) -> None:
    kw = dict(data=str(counting["responses"]), target=str(counting["target"]), layer_ids=[0, 1], shard_size=16,
              store_dtype="float32", dtype="float32", out=str(tmp_path / "x"))
    extract(ExtractConfig(stop_after=1, **kw))  # "killed" after one shard
    part = tmp_path / "x"
    assert json.loads((part / "manifest.json").read_text())["complete"] is False
    (part / "shard-00001.safetensors.tmp").write_bytes(b"half a shard")  # torn temp file of the kill
    extract(ExtractConfig(stop_after=1, **kw))
    # A kill between the shard's os.replace and the manifest update: the shard is redone.
    manifest = json.loads((part / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:1]
    (part / "manifest.json").write_text(json.dumps(manifest))
    extract(ExtractConfig(**kw))
    ref = counting["features"]
    names = sorted(p.name for p in ref.iterdir())
    assert names == sorted(p.name for p in part.iterdir() if not p.name.endswith(".tmp"))
    for name in names:
        assert (ref / name).read_bytes() == (part / name).read_bytes(), name
    data = FeatureShards(part)
    assert len(data) == 48 and data[47].features.shape[1] == 64


# ----------------------------------------------------------------------------- learning + engine


def test_drafter_learns_counting_to_high_acceptance(counting, tmp_path: Path) -> None:
    block = 4
    out = tmp_path / "drafter"
    train(TrainConfig(out=str(out), data=str(counting["features"]), block_size=block, num_layers=1,
                      intermediate_size=64, mask_token_id=MASK, steps=200, lr=3e-3, batch_size=4, log_every=50,
                      save_every=1000, threads=1))
    held = write_prompts(tmp_path / "held.jsonl", 8, seed=1)
    res = evaluate(EvalConfig(target=str(counting["target"]), drafter=str(out), prompts=[str(held)],
                              methods=["dflash", "ddtree"], budgets=[8], max_tokens=40, dtype="float32"),
                   verbose=False)
    assert res["dflash"]["all"] >= 0.8 * block, res
    assert res["ddtree@8"]["all"] >= res["dflash"]["all"] - 1e-9, res


@pytest.mark.slow
def test_selector_drafter_learns_counting_through_the_engine(counting, tmp_path: Path) -> None:
    """A --selector drafter trained on the counting task drafts long accepted chains and trees in the
    engine with its selector on (and its marginal tree stays lossless and useful with it off)."""
    block = 4
    out = tmp_path / "d2"
    train(TrainConfig(out=str(out), data=str(counting["features"]), block_size=block, num_layers=1,
                      intermediate_size=64, mask_token_id=MASK, steps=200, lr=3e-3, batch_size=4, log_every=50,
                      save_every=1000, threads=1, selector=True, selector_rank=8, selector_top_k=4, conv_group_size=8))
    held = write_prompts(tmp_path / "held.jsonl", 8, seed=1)
    kw = dict(target=str(counting["target"]), drafter=str(out), prompts=[str(held)], methods=["dflash", "ddtree"],
              budgets=[8], max_tokens=40, dtype="float32")
    res = evaluate(EvalConfig(**kw), verbose=False)
    assert res["dflash"]["all"] >= 0.8 * block, res
    assert res["ddtree@8"]["all"] >= res["dflash"]["all"] - 1e-9, res
    off = evaluate(EvalConfig(**kw, use_selector=False), verbose=False)
    assert off["ddtree@8"]["all"] >= 0.8 * block, off


def test_resumed_training_equals_uninterrupted(counting, tmp_path: Path) -> None:
    kw = dict(data=str(counting["features"]), block_size=4, num_layers=1, intermediate_size=64,
              mask_token_id=MASK, steps=6, batch_size=4, grad_accum=2, log_every=2, save_every=100, threads=1)
    train(TrainConfig(out=str(tmp_path / "a"), **kw))
    assert train(TrainConfig(out=str(tmp_path / "b"), stop_after=3, **kw))["stopped"]
    train(TrainConfig(out=str(tmp_path / "b"), **kw))
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_resume_with_other_settings_is_refused_and_named(counting, tmp_path: Path, capsys) -> None:
    """A rerun with new --steps/--lr/--batch-size names what changed instead of claiming a resume;
    the same settings on a finished run say there is nothing to train; the log explains its numbers."""
    kw = dict(out=str(tmp_path / "r"), data=str(counting["features"]), block_size=4, num_layers=1,
              intermediate_size=64, mask_token_id=MASK, steps=2, batch_size=2, log_every=1, threads=1)
    first = train(TrainConfig(**kw))
    out = capsys.readouterr().out
    assert "tau~ = teacher-forced chain acceptance" in out and "loss = slot-weighted cross-entropy" in out
    for change, name in ((dict(steps=4), "steps: 2 -> 4"), (dict(lr=1e-3), "lr: 0.0006 -> 0.001"),
                         (dict(batch_size=3), "batch_size: 2 -> 3"), (dict(selector=True), "selector: False -> True")):
        with pytest.raises(FlashtreeError, match="other settings") as e:
            train(TrainConfig(**(kw | change)))
        assert name in str(e.value)
    again = train(TrainConfig(**(kw | dict(log_every=5, threads=1))))  # output-only settings may change
    assert "nothing to train" in capsys.readouterr().out and again == first
    train(TrainConfig(**(kw | dict(steps=3, resume=False))))  # a fresh start is still possible


def test_selector_training_writes_a_dflash2_drafter(counting, tmp_path: Path) -> None:
    """--selector trains convolutions and selector jointly; the output uses the DFlash2 layout and
    loads back with every trained tensor."""
    out = tmp_path / "d2"
    summary = train(TrainConfig(out=str(out), data=str(counting["features"]), block_size=4, num_layers=1,
                                intermediate_size=64, mask_token_id=MASK, steps=3, batch_size=2, threads=1,
                                selector=True, selector_rank=4, selector_top_k=5, conv_kernel_size=2))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg["dflash_config"][k] for k in ("selector_rank", "selector_top_k", "conv_kernel_size",
                                                  "conv_group_size")} == \
        {"selector_rank": 4, "selector_top_k": 5, "conv_kernel_size": 2, "conv_group_size": 32}
    target = load_target(counting["target"], torch.float32, torch.device("cpu"))
    drafter = load_drafter(out, target, torch.float32, torch.device("cpu"))
    assert isinstance(drafter, DFlash2Drafter)
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(v, ck["drafter"][k].float())
    assert "unary_loss" in ck["log"][-1] and summary["steps"] == 3
    conv = ck["drafter"]["layers.0.attention_conv.kernel_projection.weight"]
    assert conv.abs().max() > 0  # started at zero (identity convolutions): the convolutions were trained


def test_regenerate_mixes_temperatures(counting, tmp_path: Path) -> None:
    """--temperature 0,0.7,1 answers prompt n at the (n mod 3)-th temperature (one response per
    prompt); --each-temperature answers each prompt at all three. T = 0 responses are the greedy
    ones, and reruns resume without duplicates."""
    greedy = {json.loads(x)["id"]: json.loads(x)["response_ids"] for x in counting["responses"].read_text().splitlines()}
    kw = dict(prompts=str(counting["prompts"]), target=str(counting["target"]), method="ar", max_tokens=12,
              chunk=16, dtype="float32", limit=6, temperature=[0.0, 0.7, 1.0])
    mix = tmp_path / "mix.jsonl"
    assert regenerate(RegenerateConfig(out=str(mix), **kw))["written"] == 6
    rows = [json.loads(x) for x in mix.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(6)]
    assert [r["temperature"] for r in rows] == [0.0, 0.7, 1.0] * 2
    each = tmp_path / "each.jsonl"
    stats = regenerate(RegenerateConfig(out=str(each), each_temperature=True, **kw))
    assert stats["responses"] == 18 and stats["written"] == 18
    rows = [json.loads(x) for x in each.read_text().splitlines()]
    assert [r["id"] for r in rows[:3]] == ["p0@t0", "p0@t0.7", "p0@t1"]
    assert [r["temperature"] for r in rows] == [0.0, 0.7, 1.0] * 6
    for r in rows:
        if r["temperature"] == 0.0:
            assert r["response_ids"] == greedy[r["id"].split("@")[0]][:12]
    assert regenerate(RegenerateConfig(out=str(each), each_temperature=True, **kw))["skipped"] == 18
    from flashtree.cli import build_parser

    a = build_parser().parse_args(["train", "regenerate", "p.jsonl", "--out", "o", "--temperature", "0,0.7,1"])
    assert a.temperature == [0.0, 0.7, 1.0] and not a.each_temperature


def test_online_mode_trains_from_sequences(counting, tmp_path: Path) -> None:
    out = tmp_path / "online"
    summary = train(TrainConfig(out=str(out), sequences=str(counting["responses"]), target=str(counting["target"]),
                                layer_ids=[0, 1], block_size=4, num_layers=1, mask_token_id=MASK, steps=2,
                                batch_size=2, threads=1))
    assert summary["steps"] == 2 and summary["layer_ids"] == [0, 1]
    from flashtree import LLM, SamplingParams

    llm = LLM(target=str(counting["target"]), drafter=str(out), method="ddtree", budget=8, dtype="float32")
    assert llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6))[0].token_ids == [6, 7, 8, 9, 10, 11]


def test_torchrun_two_processes(counting, tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "flashtree.cli", "train", "train", "--data", str(counting["features"]), "--out", str(out),
           "--block-size", "4", "--num-layers", "1", "--mask-token-id", str(MASK), "--steps", "3",
           "--batch-size", "2", "--grad-accum", "2", "--threads", "1", "--log-every", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "train_args.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_cli_registers_train_subcommands() -> None:
    from flashtree.cli import build_parser

    parser = build_parser()
    for cmd in ("regenerate", "extract", "train", "eval", "compare", "branch", "demo"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["train", cmd, "--help"])
        assert e.value.code == 0


def test_branch_acceptance_replays_the_engine(counting, tmp_path: Path) -> None:
    """The offline replay of greedy DDTree rounds gives the engine's tau, and its spine/sibling
    counts add up to the accepted nodes."""
    from flashtree.train.tau import BranchConfig, branch_acceptance

    held = write_prompts(tmp_path / "held.jsonl", 4, seed=2)
    drafter = make_drafter(tmp_path / "d", target_layers=2, vocab=VOCAB, hidden=32, layers=1, block_size=4,
                           layer_ids=[0, 1], mask_token_id=MASK)
    res = branch_acceptance(BranchConfig(target=str(counting["target"]), drafter=str(drafter), prompts=[str(held)],
                                         budget=6, max_tokens=20))
    eng = evaluate(EvalConfig(target=str(counting["target"]), drafter=str(drafter), prompts=[str(held)],
                              methods=["ddtree"], budgets=[6], max_tokens=20, dtype="float32"), verbose=False)
    assert res["tau"] == pytest.approx(eng["ddtree@6"]["all"])
    assert res["spine"] + res["sibling"] == res["emitted"] - res["rounds"]


def test_compare_interleaves_variants(counting, tmp_path: Path) -> None:
    """compare runs ar and drafters on the same prompts; greedy tau of a variant equals eval's."""
    from flashtree.train.tau import CompareConfig, compare

    held = write_prompts(tmp_path / "held.jsonl", 5, seed=3)
    drafter = make_drafter(tmp_path / "d", target_layers=2, vocab=VOCAB, hidden=32, layers=1, block_size=4,
                           layer_ids=[0, 1], mask_token_id=MASK)
    res = compare(CompareConfig(variants=["ar", str(drafter)], target=str(counting["target"]), prompts=[str(held)],
                                budget=6, max_tokens=16, max_batch=2, dtype="float32"), verbose=False)
    eng = evaluate(EvalConfig(target=str(counting["target"]), drafter=str(drafter), prompts=[str(held)],
                              methods=["ddtree"], budgets=[6], max_tokens=16, dtype="float32"), verbose=False)
    assert res["ar"]["all"] == 1.0 and res[str(drafter)]["all"] == pytest.approx(eng["ddtree@6"]["all"])
    assert res["ar"]["tok_s"] > 0 and res[str(drafter)]["tok_s"] > 0
    with pytest.raises(FlashtreeError, match="only option"):
        compare(CompareConfig(variants=[f"{drafter}:fast"], target=str(counting["target"]), prompts=[str(held)]))
