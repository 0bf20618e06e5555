"""Would EAGLE-style MTP trees pay against MTP's chain? Measured on the target's own greedy text.

    OMP_NUM_THREADS=1 python benchmarks/mtp_trees.py --num-prompts 20 --max-tokens 128

An MTP tree keeps the head's top-b_s tokens at recursive step s. Along the target's greedy
continuation the walk follows the true tokens, so a tree accepts step s exactly when every true
token up to s is among its parent's top-b: the head's recursion fed the TRUE tokens and its own
hidden states (train.mtp.step_outputs, the recursion the engine runs; a test checks they agree)
gives every shape's acceptance from one pass, rounds replayed as the engine plays them. The
round's cost: the chain's measured draft and overhead stages (an mtp engine on the same prompts),
plus the target's verify of N nodes from the cost curve, anchored at the chain's measured verify.
The tree's draft is priced as the chain's, which favours the trees (their head steps run more
rows, with a tree mask): a shape that does not beat the chain here does not beat it built.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from flashtree import LLM, SamplingParams
from flashtree.bench.cost import measure_cost_curve
from flashtree.bench.grid import BenchSpec, encode_prompt, load_prompts
from flashtree.models.context import ForwardContext
from flashtree.train.mtp import step_outputs


def shapes(k: int) -> list[tuple[int, ...]]:
    """Per-step branching b_1..b_k: the chain, then wider first steps and 2-ary prefixes."""
    out = [(1,) * k]
    for first in (2, 3, 4):
        out.append((first,) + (1,) * (k - 1))
    for wide in range(2, k + 1):
        out.append((2,) * wide + (1,) * (k - wide))
    out.append((3, 2) + (1,) * (k - 2))
    return out


def nodes(shape: tuple[int, ...]) -> int:
    """Verify window: the root and every node of the b-ary expansion."""
    return 1 + sum(itertools.accumulate(shape, lambda a, b: a * b))


@torch.no_grad()
def ranks(llm: LLM, seq: list[int], k: int) -> torch.Tensor:
    """[T-1, k]: at entry t, the rank of the true token x[t+s+1] in step s's distribution (0 = argmax)."""
    runner = llm.engine.runner
    target, mtp = runner.target, runner.mtp
    ids = torch.tensor([seq])
    cache = target.new_cache(1, len(seq))
    feats = target(ids, ForwardContext.prefill(cache, [0], len(seq)), mtp.feature_layers).features
    outs = step_outputs(mtp.head, target.embed_tokens, ids, target.norm(feats), k)
    n = len(seq) - 1
    labels = torch.nn.functional.pad(ids, (0, k + 1))[0]
    out = torch.full((n, k), 1 << 30, dtype=torch.long)
    for s, o in enumerate(outs, start=1):
        logits = target.lm_head(o[0]).float()
        truth = labels[s + 1 : s + 1 + n]
        out[:, s - 1] = (logits > logits.gather(1, truth[:, None])).sum(1)
    return out


def replay(rank: torch.Tensor, prompt_len: int, total: int, shape: tuple[int, ...]) -> tuple[int, int]:
    """(tokens, rounds) of the walk over the continuation: from n committed, the tree accepts the
    leading steps whose true token ranks below that step's branching."""
    n, tokens, rounds = prompt_len, 0, 0
    while n < total:
        run = 0
        for s, b in enumerate(shape):
            if n + s + 1 >= total or rank[n - 1, s] >= b:
                break
            run += 1
        tokens += 1 + run
        rounds += 1
        n += 1 + run
    return tokens, rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="3,5")
    ap.add_argument("--num-prompts", type=int, default=20, help="per suite (code, prose)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="timed forwards per size and curve")
    ap.add_argument("--curves", type=int, default=8, help="cost curves measured (each size's best is kept)")
    ap.add_argument("--mtp-head", help="default: the demo target's head")
    a = ap.parse_args()
    ks = [int(x) for x in a.ks.split(",")]
    prompts = [p for ps in load_prompts(BenchSpec(num_prompts=a.num_prompts)).values() for p in ps]
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for k in ks:
        llm = LLM(method="mtp", num_speculative_tokens=k, mtp_head=a.mtp_head, max_batch=1, dtype="float32",
                  device="cpu", prefix_cache=False)
        ids = [encode_prompt(llm.engine, p) for p in prompts]
        llm.generate(ids[:2], greedy)  # warm up
        outs = llm.generate(ids, greedy)
        rounds = sum(o.stats.rounds for o in outs)
        stage = {s: sum(o.stats.stage_seconds[s] for o in outs) / rounds for s in ("draft", "verify", "tree", "commit")}
        context = int(statistics.median(len(x) for x in ids)) + a.max_tokens // 2
        sizes = sorted({nodes(s) for s in shapes(k)})
        runner = llm.engine.runner
        # Several short curves, each size's best over all of them: the sizes interleave in time, so a
        # busy stretch of the shared machine does not land on one size alone.
        verify: dict[int, float] = {}
        chain_verify = float("inf")
        for _ in range(a.curves):
            curve = measure_cost_curve(runner.target, None, sizes, [k + 1], context, [0.0], repeats=a.repeats)
            for p in curve.tree:
                verify[p.nodes] = min(verify.get(p.nodes, float("inf")), p.verify_ms(0.0))
            chain_verify = min(chain_verify, next(p.verify_ms(0.0) for p in curve.chain if p.nodes == k + 1))
        scale = 1e3 * stage["verify"] / chain_verify  # the run's conditions, anchored at the chain
        others = 1e3 * (stage["draft"] + stage["tree"] + stage["commit"])
        seqs = [x + o.token_ids for x, o in zip(ids, outs)]
        all_ranks = [ranks(llm, s, k) for s in seqs]
        print(f"\nk={k}: chain round {1e3 * sum(stage.values()):.2f} ms (draft {1e3 * stage['draft']:.2f}, "
              f"verify {1e3 * stage['verify']:.2f}), engine tau {sum(sum(o.stats.accept_lengths) for o in outs) / rounds:.3f}")
        print(f"verify ms (best of {a.curves} curves x {a.repeats}): chain {chain_verify:.3f}, "
              + ", ".join(f"{n} nodes {v:.3f}" for n, v in sorted(verify.items())))
        print("| shape (b per step) | nodes | tau | round ms | tok/s vs chain |")
        print("|---|---|---|---|---|")
        base = None
        for shape in shapes(k):
            tok = rnd = 0
            for x, r, s in zip(ids, all_ranks, seqs):
                t, n = replay(r, len(x), len(s), shape)
                tok, rnd = tok + t, rnd + n
            tau = tok / rnd
            n_nodes = nodes(shape)
            ms = others + scale * (chain_verify if shape == (1,) * k else verify[n_nodes])
            rate = tau / ms
            base = base or rate
            print(f"| {'-'.join(map(str, shape))} | {n_nodes} | {tau:.3f} | {ms:.2f} | {rate / base:.3f}x |")


if __name__ == "__main__":
    main()
