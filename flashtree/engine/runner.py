"""The speculative round: draft -> tree -> verify -> walk -> commit, batched over requests.

Stages as timed: draft = drafter forward + LM head + appending the accepted nodes' features to
the drafter's context; tree = building the tree; verify = target forward (mask included) +
per-node token choice; commit = accept walk + the round's one host read + KV compaction.

The round touches the host twice: on the way in, one non-blocking copy of staged inputs (slots,
starts, roots); on the way out, one `.tolist()` of accepted counts and tokens (plus, for
budget="auto", the expected acceptance that sizes the next round). Everything between stays on
the device. The runner owns every cache length: it commits the target and drafter caches.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from contextlib import contextmanager

import torch
from torch import Tensor

from flashtree.config import EngineConfig
from flashtree.cache import RecurrentState
from flashtree.engine.budget import AutoBudget
from flashtree.engine.compiled import Compiler
from flashtree.engine.logprobs import pack, unpack
from flashtree.engine.sequence import Request, TokenLogprob
from flashtree.engine.shapes import batch_bucket, budget_bucket, key_bucket, prefill_chunks
from flashtree.errors import FlashtreeError
from flashtree.models.context import ForwardContext, SlotBatch
from flashtree.models.dflash import DFlashDrafter
from flashtree.models.dflash2 import DFlash2Drafter
from flashtree.models.transformer import ForwardOutput
from flashtree.sampler import SamplingBatch, SamplingStage, pick, processed_logprobs
from flashtree.sampling import SamplingParams
from flashtree.tree import TreeSpec, accept_walk, build_chain, build_tree, chain_spec
from flashtree.tree.budget import expected_accepts, truncate
from flashtree.tree.markov import build_markov_chain, build_markov_tree


class StageClock:
    """Wall time per stage. With `sync`, waits for the device so GPU time lands in its stage.
    Time spent compiling a new bucket (compiler.seconds) is left out of the stage it fell in."""

    def __init__(self, device: torch.device, sync: bool, compiler: Compiler) -> None:
        self.sync = sync and device.type == "cuda"
        self.compiler = compiler
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), self.compiler.seconds
        yield
        if self.sync:
            torch.cuda.synchronize()
        spent = time.perf_counter() - t0 - (self.compiler.seconds - c0)
        self.seconds[name] = self.seconds.get(name, 0.0) + spent


class InputStage:
    """A round's host inputs (slots, starts, roots) staged in one fixed host buffer, pinned on
    CUDA, and sent with one non-blocking copy into a fixed device buffer.

    Reusing the pinned buffer is safe: the previous round's copy finished before that round's
    one read returned, and the next round writes it only after.
    """

    @torch.inference_mode()  # inference tensors, like everything else a round touches
    def __init__(self, size: int, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(3, size, dtype=torch.long, pin_memory=on_cuda)
        self.rows = self.host.numpy()
        self.device = torch.empty(3, size, dtype=torch.long, device=device) if device.type != "cpu" else self.host

    def upload(self, slots: list[int], starts: list[int], roots: list[int]) -> tuple[SlotBatch, Tensor]:
        n = len(slots)
        self.rows[0, :n], self.rows[1, :n], self.rows[2, :n] = slots, starts, roots
        if self.device is not self.host:
            self.device.copy_(self.host, non_blocking=True)
        d = self.device
        return SlotBatch(list(slots), list(starts), d[0, :n], d[1, :n]), d[2, :n]


class ModelRunner:
    """Runs prefill chunks and rounds over the engine's caches, which it owns (lengths included).

    With static shapes (on with compile, or EngineConfig.static_shapes) every forward is padded to
    a bucket (flashtree.engine.shapes): padded batch rows use a dummy slot past max_batch whose
    results are dropped. With compile, the target forward (prefill chunks and verify windows), the
    drafter forward and context append, the tree build and the accept walk run through
    torch.compile (flashtree.engine.compiled).
    """

    def __init__(self, config: EngineConfig, target, drafter: DFlashDrafter | None, device: torch.device) -> None:
        self.config = config
        self.target = target
        self.drafter = drafter
        self.device = device
        self.method = config.method
        self.static = config.static_shapes if config.static_shapes is not None else config.compile
        self.block_size = drafter.block_size if drafter is not None else 1
        self.feature_layers = tuple(drafter.args.target_layer_ids) if drafter is not None else ()
        self.use_selector = selector_on(drafter, config.use_selector)
        self.max_window = 1 + (config.tree_budget if self.method == "ddtree" else self.block_size - 1)
        cache_len = config.max_model_len + self.max_window
        self.max_rows = batch_bucket(config.max_batch) if self.static else config.max_batch
        self.dummy_slot = config.max_batch  # padded batch rows write here; nothing reads it back
        slots = config.max_batch + (1 if self.static else 0)
        self.cache = target.new_cache(slots, cache_len)
        self.draft_cache = drafter.new_cache(slots, cache_len) if drafter is not None else None
        self.inputs = InputStage(self.max_rows, device)
        self.sampling_inputs = SamplingStage(self.max_rows, device)
        self.compiler = Compiler(device, config.compile)
        self.compiler.keep([t for c in (self.cache, self.draft_cache) if c is not None
                            for t in vars(c).values() if isinstance(t, Tensor) and t.numel()])
        self.run_prefill = self.compiler(self._prefill)
        self.run_verify = self.compiler(self._verify)
        self.run_draft = self.compiler(self._draft)
        self.run_append = self.compiler(self._append)
        # Compiled, the builder runs without its CPU early stop (host reads would split the graph);
        # a builder without that switch stays eager on the CPU.
        compile_tree = config.compile and (_BUILD_PRUNES or device.type != "cpu")
        self.run_tree = self.compiler(_build_tree) if compile_tree else build_tree
        self.run_walk = self.compiler(accept_walk)
        sync = config.stage_timing if config.stage_timing is not None else device.type != "cuda"
        self.clock = StageClock(device, sync, self.compiler)
        self.auto = None
        if self.method == "ddtree" and config.budget == "auto":
            self.auto = AutoBudget.measure(target, drafter, self.cache, self.draft_cache, config.max_budget)
            self.auto_columns = torch.tensor(self.auto.candidates, device=device) - 1
        # budget="auto" sizes each round from the previous round's draft, read with that round's results.
        self.expected: dict[str, list[float]] = {}  # request id -> expected accepts at each auto candidate
        self.prompt_logits: dict[int, Tensor] = {}  # slot -> its complete prompt's last logits, until start_samples
        self.saved_states: dict[int, RecurrentState] = {}  # prefix reuse on a hybrid target: key -> state

    @property
    def compile_seconds(self) -> float:
        """Seconds this process spent compiling buckets so far (0 without compile)."""
        return self.compiler.seconds

    def round_budget(self, n: int) -> int:
        """Per-request tree budget for a batch of n: capped so all trees fit max_round_tokens
        (with static shapes, to a candidate budget: the window stays in a bucket)."""
        cap = max(1, self.config.max_round_tokens // n - 1)
        if self.static:
            return budget_bucket(self.config.tree_budget, cap)
        return min(self.config.tree_budget, cap)

    def key_len(self, batch: SlotBatch, n: int) -> int:
        """Keys a window of n nodes attends: exact, or its bucket with static shapes."""
        keys = batch.max_start + n
        return key_bucket(keys, self.cache.max_len) if self.static else keys

    # ---- slots and prefill ----------------------------------------------------------------

    def seat(self, slot: int, source: int | None, length: int, state_key: int | None = None) -> None:
        """Start a slot empty (source None), or holding source's first `length` committed rows in
        the target and drafter caches (a shared prefix; a hybrid target also takes the recurrent
        state saved after them under `state_key`, unless source holds exactly `length` tokens)."""
        if source is None:
            self.cache.set_length(slot, 0)
            if self.drafter is not None:
                self.draft_cache.set_length(slot, 0)
            return
        state = self.saved_states[state_key] if state_key is not None else None
        self.cache.copy_prefix(source, slot, length, state)
        if self.drafter is not None:
            self.draft_cache.copy_prefix(source, slot, length)

    def save_state(self, slot: int, key: int) -> None:
        """Keep a hybrid target's recurrent state at the slot's committed length under `key` (for
        prefix reuse). It stays here, on each rank's own device, until drop_state(key)."""
        self.saved_states[key] = self.cache.save_state(slot)

    def drop_state(self, key: int) -> None:
        self.saved_states.pop(key, None)

    @torch.inference_mode()
    def prefill(self, req: Request, end: int) -> None:
        """Append prompt tokens [num_computed, end) to the slot, target and drafter caches (a
        chunk: it attends to what the slot holds, and a hybrid target's recurrence continues
        from there). Once the prompt is complete, its last logits wait for start_samples. A
        request that asked for prompt logprobs gets those of the chunk's next tokens. With static
        shapes the chunk runs as power-of-two pieces (flashtree.engine.shapes.prefill_chunks)."""
        for start, stop in prefill_chunks(req.num_computed, end, self.static):
            self.prefill_piece(req, start, stop)

    def prefill_piece(self, req: Request, start: int, end: int) -> None:
        n = end - start
        ids = torch.tensor([req.prompt_ids[start:end]], device=self.device)
        batch = SlotBatch.of(self.cache, [req.slot])
        scored = req.prompt_logprobs is not None
        ctx, out = self.run_prefill(ids, batch, self.key_len(batch, n), scored)
        self.cache.commit(ctx, [n])
        if self.drafter is not None:
            dctx = self.run_append(batch, out.features, None, self.key_len(batch, 0))
            self.draft_cache.commit(dctx, [n])
        if scored:
            self.score_prompt(req, out.logits, start, end)
        if end == len(req.prompt_ids):
            self.prompt_logits[req.slot] = out.logits[:, -1:]

    def _prefill(self, ids: Tensor, batch: SlotBatch, key_len: int, all_logits: bool
                 ) -> tuple[ForwardContext, ForwardOutput]:
        ctx = ForwardContext.prefill(self.cache, batch, ids.shape[1], key_len)
        return ctx, self.target(ids, ctx, self.feature_layers, last_only=not all_logits)

    def score_prompt(self, req: Request, logits: Tensor, start: int, end: int) -> None:
        """Prompt logprobs: logits [1, n, V] at positions start.. score prompt tokens start+1..
        under the target's plain distribution (log-softmax): no prompt token was sampled, so no
        temperature or filter applies to it."""
        count = min(end, len(req.prompt_ids) - 1) - start
        if count <= 0:
            return
        k = req.params.prompt_logprobs
        tokens = req.prompt_ids[start + 1:start + 1 + count]
        lp = torch.log_softmax(logits[:, :count].to(torch.promote_types(logits.dtype, torch.float32)), -1)
        packed = pack(lp, torch.tensor([tokens], device=self.device), k)
        req.prompt_logprobs.extend(unpack(packed.flatten().tolist(), tokens, k, k))

    @torch.inference_mode()
    def start_samples(self, reqs: list[Request]) -> tuple[list[int], list[list[TokenLogprob] | None]]:
        """reqs[0] has just prefilled its prompt: copy it into the other samples' slots (a group's,
        seated with it), then each draws its first token from the prompt's last logits (one
        read). Returns the tokens, and the logprob entry of those samples that keep logprobs."""
        first = reqs[0]
        n = len(first.prompt_ids)
        for r in reqs[1:]:
            self.seat(r.slot, first.slot, n)
        x = self.prompt_logits.pop(first.slot).expand(len(reqs), -1, -1)
        sampling = SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs], self.device,
                                       self.sampling_inputs)
        picks = pick(x, sampling, torch.full((len(reqs), 1), n, device=self.device))
        k = max((r.params.logprobs or 0 for r in reqs if r.logprobs is not None), default=None)
        if k is None:
            return picks[:, 0].tolist(), [None] * len(reqs)
        packed = pack(processed_logprobs(x, sampling), picks, k)
        rows = torch.cat([picks.double(), packed.flatten(1)], dim=1).tolist()
        tokens = [int(row[0]) for row in rows]
        return tokens, [unpack(row[1:], [t], r.params.logprobs or 0, k) if r.logprobs is not None else None
                        for r, row, t in zip(reqs, rows, tokens)]

    @torch.inference_mode()
    def step(self, reqs: list[Request]) -> tuple[list[list[int]], dict[str, float], list[list[TokenLogprob] | None]]:
        """One round for every request in `reqs`: each one's emitted tokens, the stage times, and
        the emitted tokens' logprobs for requests that keep them (else None)."""
        self.clock.seconds = {}
        slots = [r.slot for r in reqs]
        starts = [self.cache.lengths[s] for s in slots]
        roots = [r.bonus for r in reqs]
        params, seeds = [r.params for r in reqs], [r.seed for r in reqs]
        if self.static:  # pad the batch to its bucket with greedy rows on the dummy slot
            pad = batch_bucket(len(reqs)) - len(reqs)
            slots, starts, roots = slots + [self.dummy_slot] * pad, starts + [0] * pad, roots + [0] * pad
            params, seeds = params + [GREEDY] * pad, seeds + [0] * pad
        batch, root_tokens = self.inputs.upload(slots, starts, roots)
        sampling = SamplingBatch.build(params, seeds, self.device, self.sampling_inputs)
        spec, plan = self.draft(batch, root_tokens, reqs)
        with self.clock.stage("verify"):
            ctx, out = self.run_verify(batch, spec, self.key_len(batch, spec.num_nodes))
            picks = pick(out.logits, sampling, ctx.positions + 1, spec.depth_bound + 1)
        with self.clock.stage("commit"):
            walk = self.run_walk(spec, picks)
            scores = self.round_logprobs(out.logits, walk.path, walk.tokens, reqs, sampling)
            counts, emitted, logprobs = self.read_round(walk.num_nodes, walk.tokens, reqs, plan, scores)
            self.cache.commit(ctx, counts, walk.path, walk.num_nodes)
        if self.drafter is not None:
            # Projecting the accepted nodes' features into drafter K/V is drafter model work.
            with self.clock.stage("draft"):
                dctx = self.run_append(batch, out.features, walk.path, self.key_len(batch, 0))
                self.draft_cache.commit(dctx, counts)
        return emitted, dict(self.clock.seconds), logprobs

    def _verify(self, batch: SlotBatch, spec: TreeSpec, key_len: int) -> tuple[ForwardContext, ForwardOutput]:
        ctx = ForwardContext.verify(self.cache, batch, spec, key_len)
        return ctx, self.target(spec.tokens.clamp(min=0), ctx, self.feature_layers)

    def _draft(self, batch: SlotBatch, roots: Tensor, key_len: int) -> tuple[Tensor, Tensor]:
        """Drafter hidden states and draft logits [R, L-1, *] of the block [root, MASK x (L-1)]."""
        block = torch.full((roots.shape[0], self.block_size), self.drafter.args.mask_token_id, device=roots.device)
        block[:, 0] = roots
        ctx = ForwardContext.block(self.draft_cache, batch, self.block_size, key_len)
        hidden = self.drafter(self.target.embed_tokens(block), ctx)[:, 1:]
        if isinstance(self.drafter, DFlash2Drafter):
            return hidden, self.drafter.logits(hidden, self.target.lm_head)
        return hidden, self.target.lm_head(hidden)

    def _append(self, batch: SlotBatch, features: Tensor, path: Tensor | None, key_len: int) -> ForwardContext:
        """Write drafter context K/V for the window's nodes on `path` (all of them when None)."""
        if path is not None:
            features = gather_nodes(features, path)
        ctx = ForwardContext.block(self.draft_cache, batch, features.shape[1], key_len)
        self.drafter.add_context(ctx, features)
        return ctx

    def draft(self, batch: SlotBatch, roots: Tensor, reqs: list[Request]) -> tuple[TreeSpec, AutoPlan | None]:
        if self.drafter is None:
            return chain_spec(roots[:, None]), None
        with self.clock.stage("draft"):
            hidden, logits = self.run_draft(batch, roots, self.key_len(batch, 0))
            markov = self.drafter.transitions(hidden, logits, roots) if self.use_selector else None
        with self.clock.stage("tree"):
            if self.method == "dflash":
                return (build_markov_chain(roots, *markov) if markov else build_chain(roots, logits)), None
            cap = self.round_budget(batch.size)

            def tree(budget: int) -> TreeSpec:  # exact top-budget under the selector's draft, or the marginals'
                spec = build_markov_tree(roots, *markov, budget) if markov else self.run_tree(roots, logits, budget)
                if self.static:
                    # The builder may stop early (fewer depths than drafted); the static bound keeps
                    # mask and walk shapes fixed. Any bound >= the true depth gives the same result.
                    spec = dataclasses.replace(spec, max_depth=min(logits.shape[1], budget))
                return spec

            if self.auto is None:
                return tree(cap), None
            # The full-size tree's expected acceptance, read with this round's results, sizes the
            # next round; this round uses the size the previous round's draft chose.
            plan = AutoPlan(self.auto, cap, self.auto_budget(reqs, cap))
            full = tree(cap)
            e = expected_accepts(full)  # [R, cap]: column b-1 is the top-b tree
            plan.expected = torch.cat([e[:, self.auto_columns[: len(plan.candidates)]],
                                       e[:, plan.budget - 1 : plan.budget]], dim=1)
            return truncate(full, plan.budget), plan

    def auto_budget(self, reqs: list[Request], cap: int) -> int:
        """This round's budget from the expectations the previous round read (cap before any)."""
        known = [self.expected[r.request_id] for r in reqs if r.request_id in self.expected]
        if not known:
            return cap
        columns = min(len(e) for e in known)
        mean = [sum(e[c] for e in known) / len(known) for c in range(columns)]
        gains = [mean[c] * len(reqs) for c in range(columns)]  # requests without a record count as the mean
        return self.auto.choose_gains(gains, len(reqs), cap)

    def round_logprobs(self, logits: Tensor, path: Tensor, tokens: Tensor, reqs: list[Request],
                       sampling: SamplingBatch) -> Tensor | None:
        """[R, A * (1 + 2k)]: the emitted tokens' logprobs and top-k at the accepted path's nodes
        (whose verify logits gave those tokens), when some request keeps logprobs."""
        keep = [r for r in reqs if r.logprobs is not None]
        if not keep:
            return None
        k = max(r.params.logprobs or 0 for r in keep)
        return pack(processed_logprobs(gather_nodes(logits, path), sampling), tokens, k).flatten(1)

    def read_round(self, num_nodes: Tensor, tokens: Tensor, reqs: list[Request], plan: AutoPlan | None,
                   scores: Tensor | None = None) -> tuple[list[int], list[list[int]], list[list[TokenLogprob] | None]]:
        """The round's one device-to-host read: accepted counts and tokens, and riding along in
        float64 (which holds every token id exactly) auto's expectations and the logprobs. Only
        the real rows are read (padding rows of a batch bucket follow them)."""
        r = len(reqs)
        packed = torch.cat([num_nodes[:r, None], tokens[:r]], dim=1)
        extra = [t[:r] for t in (plan.expected if plan is not None else None, scores) if t is not None]
        if not extra:
            host = packed.tolist()
            rest = [[] for _ in host]
        else:
            rows = torch.cat([packed.double(), *(t.double() for t in extra)], dim=1).tolist()
            w = packed.shape[1]
            host = [[int(x) for x in row[:w]] for row in rows]
            rest = [row[w:] for row in rows]
        counts = [row[0] for row in host]
        emitted = [row[1 : 1 + row[0]] for row in host]
        if plan is not None:
            e = plan.expected.shape[1]
            self.observe(plan, counts, [row[:e] for row in rest], reqs)
            rest = [row[e:] for row in rest]
        logprobs: list[list[TokenLogprob] | None] = [None] * len(reqs)
        if scores is not None:
            width = (scores.shape[1] // tokens.shape[1] - 1) // 2
            logprobs = [unpack(row, toks, r.params.logprobs or 0, width) if r.logprobs is not None else None
                        for r, row, toks in zip(reqs, rest, emitted)]
        return counts, emitted, logprobs

    def observe(self, plan: AutoPlan, counts: list[int], expected: list[list[float]], reqs: list[Request]) -> None:
        predicted = sum(e[plan.used] for e in expected)
        self.auto.observe(predicted, sum(counts) - len(counts))
        live = {r.request_id for r in reqs}
        self.expected = {k: v for k, v in self.expected.items() if k in live}
        for req, e in zip(reqs, expected):
            self.expected[req.request_id] = e[: len(plan.candidates)]


class AutoPlan:
    """One auto-sized round: its budget, and the expected accepts it reads back: one column per
    candidate budget <= cap, then the used budget's (for calibration)."""

    def __init__(self, auto: AutoBudget, cap: int, budget: int) -> None:
        self.budget = budget
        self.candidates = [b for b in auto.candidates if b <= cap]
        self.used = len(self.candidates)
        self.expected: Tensor | None = None  # [R, len(candidates) + 1]


def selector_on(drafter: DFlashDrafter | None, wanted: bool | None) -> bool:
    """Draft with the candidate selector (a Markov draft) when the drafter has one, unless turned off."""
    has = isinstance(drafter, DFlash2Drafter)
    if wanted and not has:
        raise FlashtreeError("use_selector=True needs a DFlash2 drafter (architectures DFlash2DraftModel); "
                             "this drafter has no candidate selector")
    return has and wanted is not False


GREEDY = SamplingParams()  # what padded batch rows "sample" with: argmax


def _build_tree(roots: Tensor, logits: Tensor, budget: int) -> TreeSpec:
    # Without the CPU-only early stop when the builder offers the switch: it reads host scalars,
    # which would split compiled code (and is off on other devices anyway).
    if _BUILD_PRUNES:
        return build_tree(roots, logits, budget, prune=False)
    return build_tree(roots, logits, budget)


_BUILD_PRUNES = "prune" in inspect.signature(build_tree).parameters


def gather_nodes(x: Tensor, path: Tensor) -> Tensor:
    """Rows of x [R, N, F] at node indices path [R, A] (padding -1 reads node 0)."""
    idx = path.clamp(min=0)[:, :, None].expand(-1, -1, x.shape[-1])
    return x.gather(1, idx)
