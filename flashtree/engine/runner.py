"""The speculative round: draft -> tree -> verify -> walk -> commit, batched over requests.

Stages as timed: draft = drafter forward + LM head + appending the accepted nodes' features to
the drafter's context; tree = building the tree; verify = target forward (mask included) +
per-node token choice; commit = accept walk + the round's one host read + KV compaction.

Everything between the drafter call and the commit stays on the device; the round reads
back one small tensor (accepted counts and tokens) at the end.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import Tensor

from flashtree.cache import CacheView
from flashtree.config import EngineConfig
from flashtree.engine.sequence import Request
from flashtree.errors import FlashtreeError
from flashtree.models.dflash import DFlashDrafter
from flashtree.models.dflash2 import DFlash2Drafter
from flashtree.sampling import pick_tokens
from flashtree.engine.budget import AutoBudget
from flashtree.tree import TreeSpec, accept_walk, build_chain, build_tree, chain_spec
from flashtree.tree.budget import expected_accepts, truncate
from flashtree.tree.markov import build_markov_chain, build_markov_tree


class StageClock:
    """Wall time per stage. With `sync`, waits for the device so GPU time lands in its stage."""

    def __init__(self, device: torch.device, sync: bool) -> None:
        self.sync = sync and device.type == "cuda"
        self.enabled = sync or device.type != "cuda"
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


class ModelRunner:
    def __init__(self, config: EngineConfig, target, drafter: DFlashDrafter | None, device: torch.device) -> None:
        self.config = config
        self.target = target
        self.drafter = drafter
        self.device = device
        self.method = config.method
        self.block_size = drafter.block_size if drafter is not None else 1
        self.feature_layers = tuple(drafter.args.target_layer_ids) if drafter is not None else ()
        self.use_selector = selector_on(drafter, config.use_selector)
        self.max_window = 1 + (config.tree_budget if self.method == "ddtree" else self.block_size - 1)
        cache_len = config.max_model_len + self.max_window
        self.cache = target.new_cache(config.max_batch, cache_len)
        self.draft_cache = drafter.new_cache(config.max_batch, cache_len) if drafter is not None else None
        sync = config.stage_timing if config.stage_timing is not None else device.type != "cuda"
        self.clock = StageClock(device, sync)
        self.auto = None
        self.predicted = 0.0  # drafter-expected accepted nodes of the last auto-sized round
        if self.method == "ddtree" and config.budget == "auto":
            self.auto = AutoBudget.measure(target, drafter, self.cache, self.draft_cache, config.max_budget)

    def budgets(self, n: int) -> int:
        """Per-request tree budget for a batch of n: capped so all trees fit max_round_tokens."""
        return max(1, min(self.config.tree_budget, self.config.max_round_tokens // n - 1))

    @torch.inference_mode()
    def prefill(self, req: Request) -> int:
        """Fill a fresh slot with the prompt; returns the target's first token (the first bonus)."""
        ids = torch.tensor([req.prompt_ids], device=self.device)
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        self.cache.set_length(req.slot, 0)
        out = self.target(ids, positions, self.cache.view([req.slot]), None, self.feature_layers, last_only=True)
        self.cache.set_length(req.slot, ids.shape[1])
        if self.drafter is not None:
            self.draft_cache.set_length(req.slot, 0)
            self.drafter.add_context(self.draft_cache.view([req.slot]), out.features, [ids.shape[1]])
        return int(pick_tokens(out.logits, [req.params], [req.generator])[0, -1])

    @torch.inference_mode()
    def step(self, reqs: list[Request]) -> tuple[list[list[int]], dict[str, float]]:
        """One round for every request in `reqs`; returns each one's emitted tokens."""
        self.clock.seconds = {}
        slots = [r.slot for r in reqs]
        # Host-to-device copies (roots, cache starts) happen here, before any kernel is queued,
        # so they never wait on the device mid-round.
        roots = torch.tensor([r.bonus for r in reqs], device=self.device)
        view = self.cache.view(slots)
        draft_view = self.draft_cache.view(slots) if self.drafter is not None else None
        spec = self.draft(draft_view, roots)
        with self.clock.stage("verify"):
            positions = view.starts[:, None] + spec.depths
            out = self.target(spec.tokens.clamp(min=0), positions, view, spec, self.feature_layers)
            picks = pick_tokens(out.logits, [r.params for r in reqs], [r.generator for r in reqs])
        with self.clock.stage("commit"):
            walk = accept_walk(spec, picks)
            host = torch.cat([walk.num_nodes[:, None], walk.tokens], dim=1).tolist()
            counts = [row[0] for row in host]
            self.cache.commit(view, walk.path, counts, chain=spec.is_chain)
            if self.auto is not None:
                self.auto.observe(self.predicted, sum(counts) - len(counts))
        if self.drafter is not None:
            # Projecting the accepted nodes' features into drafter K/V is drafter model work.
            with self.clock.stage("draft"):
                self.drafter.add_context(draft_view, gather_nodes(out.features, walk.path), counts)
        emitted = [row[1 : 1 + row[0]] for row in host]
        return emitted, dict(self.clock.seconds)

    def draft(self, view: CacheView | None, roots: Tensor) -> TreeSpec:
        if self.drafter is None:
            return chain_spec(roots[:, None])
        with self.clock.stage("draft"):
            block = torch.full((roots.shape[0], self.block_size), self.drafter.args.mask_token_id, device=self.device)
            block[:, 0] = roots
            hidden = self.drafter(self.target.embed_tokens(block), view)[:, 1:]
            if isinstance(self.drafter, DFlash2Drafter):
                logits = self.drafter.logits(hidden, self.target.lm_head)
            else:
                logits = self.target.lm_head(hidden)
            markov = self.drafter.transitions(hidden, logits, roots) if self.use_selector else None
        with self.clock.stage("tree"):
            if self.method == "dflash":
                return build_markov_chain(roots, *markov) if markov else build_chain(roots, logits)
            budget = self.budgets(roots.shape[0])
            spec = build_markov_tree(roots, *markov, budget) if markov else build_tree(roots, logits, budget)
            if self.auto is not None:
                # One extra host read per round: the window's size must be known to shrink it.
                expected = expected_accepts(spec).tolist()
                budget = self.auto.choose(expected, self.budgets(roots.shape[0]))
                spec = truncate(spec, budget)
                self.predicted = sum(row[min(budget, len(row)) - 1] for row in expected if row)
            return spec


def selector_on(drafter: DFlashDrafter | None, wanted: bool | None) -> bool:
    """Draft with the candidate selector (a Markov draft) when the drafter has one, unless turned off."""
    has = isinstance(drafter, DFlash2Drafter)
    if wanted and not has:
        raise FlashtreeError("use_selector=True needs a DFlash2 drafter (architectures DFlash2DraftModel); "
                             "this drafter has no candidate selector")
    return has and wanted is not False


def gather_nodes(x: Tensor, path: Tensor) -> Tensor:
    """Rows of x [R, N, F] at node indices path [R, A] (padding -1 reads node 0)."""
    idx = path.clamp(min=0)[:, :, None].expand(-1, -1, x.shape[-1])
    return x.gather(1, idx)
