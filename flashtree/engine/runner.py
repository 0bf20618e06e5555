"""The speculative round: draft -> tree -> verify -> walk -> commit, batched over requests.

Stages as timed: draft = drafter forward + LM head + appending the accepted nodes' features to
the drafter's context; tree = building the tree; verify = target forward (mask included) +
per-node token choice; commit = accept walk + the round's one host read + KV compaction.

The round touches the host twice: on the way in, non-blocking copies of staged inputs (slots,
starts, roots; the plan's index lists); on the way out, one `.tolist()` of accepted counts and
tokens (plus, for budget="auto", the draft data the speculation policy plans the next round
with, and any logprobs). Everything between stays on the device. The runner owns every cache
length: it commits the target and drafter caches. With budget="auto" it asks the policy
(flashtree/engine/policy.py) which rows draft and how each round; the drafter runs on those rows
only, and the others' drafter context is held back (flashtree/engine/draft_context.py).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import torch
from torch import Tensor

from flashtree.config import EngineConfig
from flashtree.cache import RecurrentState, SlidingDraftCache
from flashtree.engine.cost_cache import quiet, save, startup
from flashtree.engine.cost_model import CONTEXT, DEFAULT_SECONDS, CostModel, Grid, Timer
from flashtree.engine.draft_context import DeferredContext
from flashtree.engine.graphs import RoundGraphs
from flashtree.engine.logprobs import pack, unpack
from flashtree.engine.mtp_draft import MTPDraft
from flashtree.engine.policy import GRID, Policy, by_size
from flashtree.engine.round_plan import AR, RoundPlan, fixed_plan
from flashtree.engine.sequence import Request, TokenLogprob
from flashtree.engine.shapes import TREE_BUCKETS, batch_bucket, budget_bucket, key_bucket, prefill_chunks
from flashtree.engine.staging import Staging
from flashtree.errors import FlashtreeError
from flashtree.models.compiled import compile_drafter, compile_stack
from flashtree.models.context import ForwardContext, SlotBatch
from flashtree.models.dflash import DFlashDrafter
from flashtree.models.dflash2 import DFlash2Drafter
from flashtree.models.mtp import MTPHead
from flashtree.models.packed import pack_linears
from flashtree.models.transformer import ForwardOutput
from flashtree.sampler import SamplingBatch, SamplingStage, pick, processed_logprobs
from flashtree.sampling import SamplingParams
from flashtree.models.tree_attention import check_kernels
from flashtree.tree import TreeSpec, accept_walk, build_chain, build_tree, chain_spec
from flashtree.tree.markov import build_markov_chain, build_markov_tree
from flashtree.tree.mix import drop_drafts, place_rows, root_only

SAVE_AFTER = 256  # rounds of online refinement after which the cost cache is rewritten (once)
# Plain AR rounds are timed for the policy one in this many. Between two forwards the host's
# caches are cold: learning from every AR round cost about 23 us of a 3.7 ms step on the demo
# pair at c = 1, where `ar` spends nothing.
AR_TIMED_EVERY = 4
# ... and into the cost model one in this many (0.15 ms each): a multiple, so those are timed ones.
AR_REFINE_EVERY = 8 * AR_TIMED_EVERY
DRAFT_REFINE_EVERY = 8  # ... and drafting rounds (a refinement took 0.155 ms of a 12 ms chain round at c = 1)


class StageClock:
    """Wall time per stage. With `sync` (asked for: EngineConfig.stage_timing), waits for the
    device so GPU time lands in its stage; off, a CUDA round is never synced by its clock."""

    def __init__(self, device: torch.device, sync: bool) -> None:
        self.sync = sync and device.type == "cuda"
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


class InputStage:
    """A round's host inputs (slots, starts, roots, and with budget="auto" a fourth row: the rows
    of the held-back context ring its tokens park in, or in a captured round the drafting flags)
    staged in one fixed host buffer, pinned on CUDA, and sent with one non-blocking copy into a
    fixed device buffer.

    Reusing the pinned buffer is safe: the previous round's copy finished before that round's
    one read returned, and the next round writes it only after. The rows are written with one
    numpy call: between two target forwards every host call runs on cold caches, and each one
    counts on a small target.
    """

    @torch.inference_mode()  # inference tensors, like everything else a round touches
    def __init__(self, size: int, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(4, size, dtype=torch.long, pin_memory=on_cuda)
        self.rows = self.host.numpy()
        self.device = torch.empty(4, size, dtype=torch.long, device=device) if device.type != "cpu" else self.host

    def upload(self, slots: list[int], starts: list[int], roots: list[int], fourth: list[int] | None = None
               ) -> tuple[SlotBatch, Tensor, Tensor | None]:
        n = len(slots)
        k = 3 if fourth is None else 4
        self.rows[:k, :n] = (slots, starts, roots) if fourth is None else (slots, starts, roots, fourth)
        if self.device is not self.host:
            self.device.copy_(self.host, non_blocking=True)
        d = self.device
        return SlotBatch(list(slots), list(starts), d[0, :n], d[1, :n]), d[2, :n], d[3, :n] if fourth else None


class ModelRunner:
    """Runs prefill chunks and rounds over the engine's caches, which it owns (lengths included).

    With static shapes (on with compile, or EngineConfig.static_shapes) every forward is padded to
    a bucket (flashtree.engine.shapes): a fixed method's or a captured round's batch is padded with
    greedy rows on a dummy slot past max_batch, whose results are dropped. Captured (compile on CUDA, or
    capture=True), the rounds are captured at start-up, one per (batch bucket, key bucket, and
    under budget="auto" arm), and replayed through static buffers (flashtree.engine.graphs: CUDA
    graphs on CUDA, the same buffers eagerly on the CPU).
    """

    def __init__(self, config: EngineConfig, target, drafter: DFlashDrafter | MTPHead | None, device: torch.device,
                 progress: bool = True) -> None:
        self.config = config
        self.target = target
        # method="mtp": the drafter is an MTP head, run by self.mtp; the DFlash paths below see no drafter.
        mtp_head, drafter = (drafter, None) if config.method == "mtp" else (None, drafter)
        self.drafter = drafter
        self.device = device
        self.method = config.method
        captured = config.capture if config.capture is not None else config.compile and device.type == "cuda"
        self.static = captured or bool(config.static_shapes)  # captured rounds need static shapes
        self.block_size = drafter.block_size if drafter is not None else 1
        if mtp_head is not None:
            self.block_size = config.num_speculative_tokens + 1
        self.feature_layers = tuple(drafter.args.target_layer_ids) if drafter is not None else ()
        self.use_selector = selector_on(drafter, config.use_selector)
        self.max_window = 1 + (config.tree_budget if self.method == "ddtree" else self.block_size - 1)
        cache_len = config.max_model_len + self.max_window
        self.max_rows = batch_bucket(config.max_batch) if self.static else config.max_batch
        slots = config.max_batch + (1 if self.static else 0)  # the last one: padded rows' dummy slot
        self.pads = [padding_request(config.max_batch) for _ in range(self.max_rows - 1)] if self.static else []
        self.cache = target.new_cache(slots, cache_len)
        self.draft_cache = drafter.new_cache(slots, cache_len) if drafter is not None else None
        captured = captured and not isinstance(self.draft_cache, SlidingDraftCache)
        if device.type != "cpu" and self.method == "ddtree":
            check_kernels(device, self.cache.dtype)  # before any capture: every tree verify reads its answer
        cpu_alone = device.type == "cpu" and config.tensor_parallel_size == 1  # tensor parallelism stays eager
        # Before compiling (graphs call the packed products) and before auto's cost tables.
        self.packed = cpu_alone and pack_linears([target, drafter, mtp_head], config.pack_weights)
        self.compile_seconds = 0.0
        if config.compile and cpu_alone:
            # Before auto's cost tables: they time what requests will run.
            if target.compilable:
                self.compile_seconds = compile_stack(target, self.feature_layers, self.cache, self.max_rows, progress)
            if drafter is not None:
                self.compile_seconds += compile_drafter(drafter, self.draft_cache, self.max_rows, progress)
        self.mtp = None
        if mtp_head is not None:
            self.mtp = MTPDraft(mtp_head, target, config.num_speculative_tokens, slots, cache_len, device)
            self.feature_layers = self.mtp.feature_layers
        self.inputs = InputStage(self.max_rows, device)
        self.sampling_inputs = SamplingStage(self.max_rows, device)
        self.staging = Staging(device)
        sync = config.stage_timing if config.stage_timing is not None else device.type != "cuda"
        self.clock = StageClock(device, sync)
        self.timed_stages = sync or device.type == "cpu"  # stage times are real, not launch times
        self.policy: Policy | None = None
        self.deferred: DeferredContext | None = None
        if self.method == "ddtree" and config.budget == "auto":
            # Tensor-parallel ranks time the target together, so each must run the same points:
            # no time budget and no cache there (rank 0's tables are then shared: parallel/workers.py).
            tp = config.tensor_parallel_size > 1
            cost, self.cost_path, self.cost_key = startup(target, drafter, (self.draft_pass, self.build),
                                                          self.cache, self.draft_cache,
                                                          config.max_batch, self.max_window, config.max_budget,
                                                          "off" if tp else config.cost_cache,
                                                          float("inf") if tp else DEFAULT_SECONDS, self.use_selector)
            # Captured, every plan is a graph: trees of power-of-two sizes, priced by their replays (below).
            self.policy = Policy(cost, config.max_batch, self.block_size, config.max_budget, config.max_round_tokens,
                                 TREE_BUCKETS if captured else GRID)
            if not captured:  # a captured round appends every row's drafter context itself
                w = drafter.fc.weight
                self.deferred = DeferredContext(config.max_batch, w.shape[1], w.dtype, device)
        self.last_plan: RoundPlan | None = None
        self._draft_pass = 0.0
        self._last_end: float | None = None  # when the previous round returned (the engine's time between counts)
        self._timed = [0.0, 0.0]  # timed rounds' wall and CPU seconds: refinements learned on a busy CPU are not saved
        self.plain = [False] * slots  # per slot: its request never drafts, so its drafter rows are empty
        self.provisional: set[int] = set()  # slots seated speculative before their class settled: judged again
        self.prompt_logits: dict[int, Tensor] = {}  # slot -> its complete prompt's last logits, until start_samples
        self.saved_states: dict[int, RecurrentState] = {}  # prefix reuse on a hybrid target: key -> state
        self.graphs: RoundGraphs | None = None
        if captured:
            keys = sorted({key_bucket(n, self.cache.max_len) for n in range(1, self.cache.max_len + 1)})
            buckets = [b for b in (1 << i for i in range(self.max_rows.bit_length())) if b <= self.max_rows]
            self.graphs = RoundGraphs(self, buckets, keys, dummy=config.max_batch, progress=progress)
            if self.policy is not None:
                start = min(CONTEXT, self.cache.max_len - self.max_window - 1)
                self.policy.cost.replayed(self.graphs.timed(self, start, dummy=config.max_batch), batch_bucket)
        elif self.policy is not None and self.policy.cost.source == "measured":
            self.time_rounds(self.policy.cost)
            save(self.cost_path, self.cost_key, self.policy.cost)

    @torch.inference_mode()
    def time_rounds(self, cost: CostModel) -> None:
        """Set the cost model's overhead cells, what a round costs past its tables' stages (the pick,
        walk, K/V compaction, drafter context, host read), from whole eager rounds at each of its row
        points, CONTEXT keys deep: AR steps of plain rows, the chain, and a tree of about 16 nodes.
        Learned online alone, from zero, a workload's first drafting rounds would be priced at their
        stages, and on a GPU (stages not synced) every round."""
        keys = min(CONTEXT, self.cache.max_len - self.max_window - 2)
        timer = Timer(self.device, float("inf"))  # fixed repeats: tensor-parallel ranks run alike
        values = cost.overhead.values.copy()
        for i, rows in enumerate(int(r) for r in cost.overhead.xs):
            if rows > self.config.max_batch:  # a grid has two row points even at max_batch = 1
                values[i] = values[i - 1]
                continue
            tree = min(16, self.config.max_budget, budget_cap(self.config.max_round_tokens, rows))
            for column, plan in enumerate((fixed_plan(rows, "ar", self.block_size, 0),
                                           fixed_plan(rows, "dflash", self.block_size, 0),
                                           fixed_plan(rows, "ddtree", self.block_size, tree))):
                reqs = [padding_request(s) for s in range(rows)]
                for r in reqs:
                    r.speculative = column > 0

                def reset() -> None:  # every row CONTEXT keys deep, nothing held back
                    for s in range(rows):
                        self.seat(s, None, 0, speculative=column > 0)
                        self.cache.set_length(s, keys)
                        if column:
                            self.draft_cache.set_length(s, keys)

                def round_() -> None:
                    reset()
                    self.run_round(reqs, plan, rows)

                round_()  # a shape's first rounds run slower (allocation, kernel selection): two untimed
                seconds = timer(round_, repeats=3) - timer(reset)
                staged = cost.staged(rows, plan.window, plan.drafting, plan.depth, plan.tree_rows, plan.budget)
                values[i, column] = max(0.0, seconds - float(staged))
        for s in range(self.config.max_batch):
            self.seat(s, None, 0)
        cost.overhead = Grid(cost.overhead.xs, cost.overhead.ys, values, cost.overhead.monotone)
        self._last_end = None

    @property
    def capture_seconds(self) -> float:
        """Seconds start-up spent compiling the target and capturing the rounds (0 without compile)."""
        return self.compile_seconds + (self.graphs.seconds if self.graphs is not None else 0.0)

    def round_budget(self, n: int) -> int:
        """Per-request tree budget for a batch of n: capped so all trees fit max_round_tokens
        (with static shapes, to a candidate budget: the window stays in a bucket)."""
        cap = budget_cap(self.config.max_round_tokens, n)
        if self.static:
            return budget_bucket(self.config.tree_budget, cap)
        return min(self.config.tree_budget, cap)

    def key_len(self, batch: SlotBatch, n: int) -> int:
        """Keys a window of n nodes attends: exact, or its bucket with static shapes."""
        keys = batch.max_start + n
        return key_bucket(keys, self.cache.max_len) if self.static else keys

    # ---- slots and prefill ----------------------------------------------------------------

    def admit(self, req: Request, running: list[Request]) -> None:
        """Decide, as a request is seated beside `running` (itself included), whether it may ever
        draft (see Policy.admit), in the batch it is expected to run in (lifetime_rows)."""
        if self.policy is None or self.graphs is not None:
            req.speculative = True
            return
        req.speculative = self.policy.admit(req.params, lifetime_rows(req, running))
        if req.speculative and not self.policy.settled(req.params):
            self.provisional.add(req.slot)
        else:
            self.provisional.discard(req.slot)

    def judge(self, reqs: list[Request]) -> None:
        """Seat again, as admit would now, the requests admitted speculative before their class
        settled, once it has: one no arm would draft for (a scout aside) becomes plain, so its AR
        steps stop keeping the drafter's context (target features, parked rows) for drafts that
        never come. A short workload's first requests otherwise pay that for their whole lives."""
        for r in reqs:
            if r.slot in self.provisional and self.policy.settled(r.params):
                self.provisional.discard(r.slot)
                if not self.policy.admit(r.params, lifetime_rows(r, reqs), r):
                    r.speculative, self.plain[r.slot] = False, True
                    if self.deferred is not None:
                        self.deferred.reset(r.slot)
                    if self.drafter is not None:
                        self.draft_cache.set_length(r.slot, 0)

    def seat(self, slot: int, source: int | None, length: int, state_key: int | None = None,
             speculative: bool = True) -> int:
        """Start a slot empty (source None), or holding source's first `length` committed rows in
        the target and drafter caches (a shared prefix; a hybrid target also takes the recurrent
        state saved after them under `state_key`, unless source holds exactly `length` tokens).
        A slot that will not speculate gets no drafter rows. Returns the rows reused: none when a
        speculative request's source never gave its drafter the prompt."""
        if self.deferred is not None:
            self.deferred.reset(slot)
        if self.mtp is not None:
            self.mtp.seat(slot, source, length)
        plain, self.plain[slot] = self.plain[source] if source is not None else False, not speculative
        if source is None or (plain and speculative):
            self.cache.set_length(slot, 0)
            if self.drafter is not None:
                self.draft_cache.set_length(slot, 0)
            return 0
        state = self.saved_states[state_key] if state_key is not None else None
        self.cache.copy_prefix(source, slot, length, state)
        if self.drafter is not None:
            # A shared prefix is a prompt's, and the drafter holds every prompt token (prefill
            # appends them): source's held-back tokens, its output's, lie past it.
            if speculative:
                self.draft_cache.copy_prefix(source, slot, length)
            else:
                self.draft_cache.set_length(slot, 0)
        return length

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
        self._last_end = None  # the time until the next round was prefill, not that round's cost

    def prefill_piece(self, req: Request, start: int, end: int) -> None:
        n = end - start
        ids = torch.tensor([req.prompt_ids[start:end]], device=self.device)
        batch = SlotBatch.of(self.cache, [req.slot])
        scored = req.prompt_logprobs is not None
        ctx, out = self._prefill(ids, batch, self.key_len(batch, n), scored, not self.plain[req.slot])
        self.cache.commit(ctx, [n])
        if self.mtp is not None:
            self.mtp.prefill(batch, ids, out.features)
        if self.drafter is not None and not self.plain[req.slot]:
            dctx = self._append(batch, out.features, None, self.key_len(batch, 0))
            self.draft_cache.commit(dctx, [n])
        if scored:
            self.score_prompt(req, out.logits, start, end)
        if end == len(req.prompt_ids):
            self.prompt_logits[req.slot] = out.logits[:, -1:]

    def _prefill(self, ids: Tensor, batch: SlotBatch, key_len: int, all_logits: bool, features: bool = True
                 ) -> tuple[ForwardContext, ForwardOutput]:
        ctx = ForwardContext.prefill(self.cache, batch, ids.shape[1], key_len)
        return ctx, self.target(ids, ctx, self.feature_layers if features else (), last_only=not all_logits)

    def _verify(self, batch: SlotBatch, spec: TreeSpec, key_len: int, features: bool = True
                ) -> tuple[ForwardContext, ForwardOutput]:
        ctx = ForwardContext.verify(self.cache, batch, spec, key_len)
        return ctx, self.target(spec.tokens.clamp(min=0), ctx, self.feature_layers if features else ())

    def draft_pass(self, batch: SlotBatch, roots: Tensor, depth: int, key_len: int | None
                   ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        """A round's drafter work, which the cost model times as it is: the hidden states and
        logits [R, depth, *] of the block [root, MASK x (L-1)], and under DFlash2's selector each
        depth's candidates rescored given the parent's token."""
        block = torch.full((roots.shape[0], self.block_size), self.drafter.args.mask_token_id, device=roots.device)
        block[:, 0] = roots
        ctx = ForwardContext.block(self.draft_cache, batch, self.block_size, key_len)
        # A tree of b nodes is at most b deep: score only the depths the window can use.
        hidden = self.drafter(self.target.embed_tokens(block), ctx)[:, 1 : 1 + depth]
        if isinstance(self.drafter, DFlash2Drafter):
            logits = self.drafter.logits(hidden, self.target.lm_head)
        else:
            logits = self.target.lm_head(hidden)
        return hidden, logits, self.drafter.transitions(hidden, logits, roots) if self.use_selector else None

    @staticmethod
    def build(roots: Tensor, logits: Tensor, markov: tuple[Tensor, Tensor] | None, budget: int) -> TreeSpec:
        """The exact top-`budget` tree, or the chain for budget 0, under the selector's Markov draft
        when there is one."""
        if budget:
            return build_markov_tree(roots, *markov, budget) if markov else build_tree(roots, logits, budget)
        return build_markov_chain(roots, *markov) if markov else build_chain(roots, logits)

    def _append(self, batch: SlotBatch, features: Tensor, path: Tensor | None, key_len: int) -> ForwardContext:
        """Write drafter context K/V for the window's nodes on `path` (all of them when None)."""
        if path is not None:
            features = gather_nodes(features, path)
        ctx = ForwardContext.block(self.draft_cache, batch, features.shape[1], key_len)
        self.drafter.add_context(ctx, features)
        return ctx

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
            r.speculative = first.speculative
            self.seat(r.slot, first.slot, n, speculative=first.speculative)
            if first.slot in self.provisional:
                self.provisional.add(r.slot)
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
        start = time.perf_counter(), time.process_time()
        self.clock.seconds = {}
        if self.graphs is not None:
            return self.step_captured(reqs)
        real = len(reqs)
        if self.static and self.policy is None:  # pad the batch to its bucket (greedy rows, dummy slot)
            reqs = reqs + self.pads[: batch_bucket(real) - real]
        if self.provisional:
            self.judge(reqs)
        plan = self.plan(reqs)
        emitted, logprobs, (counts, held, paths) = self.run_round(reqs, plan, real)
        self.last_plan = plan
        if self.policy is not None:
            self.time_round(plan, reqs, counts, start, held, paths)
        return emitted, dict(self.clock.seconds), logprobs

    def run_round(self, reqs: list[Request], plan: RoundPlan, real: int
                  ) -> tuple[list[list[int]], list[list[TokenLogprob] | None], tuple]:
        """An eager round of `plan`: the emitted tokens and logprobs of the first `real` rows, and
        what the policy learns from it (accepted counts, held-back context appended, path codes)."""
        slots = [r.slot for r in reqs]
        starts = [self.cache.lengths[s] for s in slots]
        parking = [r.speculative for r in reqs] if self.deferred is not None else []  # AR rows of these park
        # An all-AR round parks every row at once (a plain row's write is never read: it holds nothing back).
        ring = self.deferred.rows(slots, starts) if not plan.drafting and any(parking) else None
        batch, roots, ring_rows = self.inputs.upload(slots, starts, [r.bonus for r in reqs], ring)
        sampling = SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs], self.device, self.sampling_inputs)
        staged, flush = self.stage(plan, reqs)
        held = (0.0, 0)  # the held-back context appended this round: seconds, tokens
        if flush:
            f0 = time.perf_counter()
            with self.clock.stage("draft"):
                self.append_held(flush, staged)
            held = (time.perf_counter() - f0, sum(n * len(group) for n, group in flush.items()))
        spec = self.draft(batch, roots, plan, staged)
        with self.clock.stage("verify"):
            features = self.mtp is not None or (self.drafter is not None and (plan.drafting > 0 or any(parking)))
            ctx, out = self._verify(batch, spec, self.key_len(batch, spec.num_nodes), features)
            picks = pick(out.logits, sampling, ctx.positions + 1, spec.depth_bound + 1)
        with self.clock.stage("commit"):
            walk = accept_walk(spec, picks)
            codes = path_codes(spec, walk.path) if plan.measure else None
            scores = self.round_logprobs(out.logits, walk.path, walk.tokens, reqs, sampling)
            counts, emitted, logprobs, paths = self.read_round(walk.num_nodes, walk.tokens, reqs, scores, codes)
            counts, emitted, logprobs = counts[:real], emitted[:real], logprobs[:real]  # padding rows end here
            self.cache.commit(ctx, counts, walk.path, walk.num_nodes)
        if self.drafter is not None:
            # Projecting the accepted nodes' features into drafter K/V is drafter model work.
            with self.clock.stage("draft"):
                self.extend_context(plan, staged, batch, out.features, walk, counts, slots, ring_rows)
        elif self.mtp is not None:
            with self.clock.stage("draft"):
                self.mtp.accept(batch, spec, walk.path, out.features, counts)
        return emitted, logprobs, (counts, held, paths)

    def time_round(self, plan: RoundPlan, reqs: list[Request], counts: list[int], start: tuple[float, float],
                   held: tuple[float, int], paths: list[list[int]] | None) -> None:
        """A round's cost includes the engine's work between rounds (emitting, scheduling):
        throughput is tokens over wall time. A long gap is an idle engine, not work. Plain AR
        rounds teach only their time, and a sample of them keeps it current. start: the round's
        wall and process CPU clocks when it began."""
        end = time.perf_counter()
        if timed(plan, self.policy.rounds):
            t0 = start[0]
            gap = t0 - self._last_end if self._last_end is not None else 0.0
            seconds = end - t0 + (gap if gap < 0.5 * (end - t0) else 0.0)
            self._timed[0] += end - t0
            self._timed[1] += time.process_time() - start[1]
            self.learn(plan, [r.slot for r in reqs], counts, seconds, held, paths)
        self._last_end = time.perf_counter()

    # ---- captured rounds (capture=True; compile=True on CUDA) --------------------------------

    def captured_plan(self, arm: int | None, rows: int) -> RoundPlan:
        """What a captured round runs: a fixed method's plan, or under budget="auto" one arm's
        (a tree of the policy's grid or the chain) for every row, None being AR steps."""
        if self.policy is None:
            return self.fixed_round_plan(rows)
        return fixed_plan(rows, "ar", self.block_size, 0) if arm is None else self.policy.arm_plan(arm, rows)

    def captured_arms(self, rows: int) -> list[int | None]:
        """The plans captured for a batch bucket of `rows`: a fixed method's one; auto's AR steps
        and every arm whose window fits max_round_tokens at the fewest real rows the bucket holds."""
        if self.policy is None:
            return [None]
        fits = self.config.max_round_tokens // (rows // 2 + 1)
        arms = range(self.policy.chain_arm + 1)
        return [None] + [a for a in arms if self.policy.arm_plan(a, rows).window <= fits]

    def captured_forward(self, batch: SlotBatch, roots: Tensor, key_len: int, plan: RoundPlan,
                         drafting: Tensor) -> dict:
        """A captured round's first piece: the drafter's block (or the MTP head's k steps), the tree
        or chain, the verify. Under auto, rows not `drafting` verify their root alone."""
        if self.mtp is not None:
            spec = self.mtp.draft(batch, roots, key_len)
        elif plan.drafting:
            _, logits, markov = self.draft_pass(batch, roots, plan.depth, key_len)
            spec = self.build(roots, logits, markov, plan.budget if plan.tree_rows else 0)
            if plan.tree_rows:
                spec = self.static_depth(spec, min(logits.shape[1], plan.budget))
            if self.policy is not None:
                spec = drop_drafts(spec, drafting)
        else:
            spec = chain_spec(roots[:, None])
        ctx, out = self._verify(batch, spec, key_len, self.drafter is not None or self.mtp is not None)
        return {"logits": out.logits, "positions": ctx.positions, "features": out.features, "spec": spec, "ctx": ctx}

    def captured_commit(self, state: dict, picks: Tensor, key_len: int, plan: RoundPlan) -> dict:
        """A captured round's second piece, given every node's pick: the accept walk, the KV
        compaction (padding rows included: they sit on the dummy slot), the drafter's context for
        every row, and under auto the accepted path's codes where the plan measures trees."""
        walk = accept_walk(state["spec"], picks)
        ctx = state["ctx"]
        self.cache.compact(ctx, walk.path, walk.num_nodes)
        if self.drafter is not None:
            self._append(ctx.batch, state["features"], walk.path, key_len)
        elif self.mtp is not None:
            self.mtp.keep(ctx.batch, state["spec"], walk.path, state["features"])
        codes = {"codes": path_codes(state["spec"], walk.path)} if plan.measure else {}
        return {"num_nodes": walk.num_nodes, "tokens": walk.tokens, "path": walk.path, **codes}

    def step_captured(self, reqs: list[Request]
                      ) -> tuple[list[list[int]], dict[str, float], list[list[TokenLogprob] | None]]:
        """One round replayed from the captured ones: inputs into static buffers, the sampler
        between the two pieces, one host read, then the host's lengths."""
        start, real = (time.perf_counter(), time.process_time()), len(reqs)
        plan = self.policy.plan(reqs) if self.policy is not None else None
        reqs = reqs + self.pads[: batch_bucket(real) - real]
        slots = [r.slot for r in reqs]
        starts = [self.cache.lengths[s] for s in slots]
        # Under auto, a drafting plan's rows that take AR steps (and the padding) drop their drafts.
        drafts = set(plan.draft_rows) if plan is not None else set()
        flags = None if plan is None else [int(i in drafts) for i in range(len(reqs))]
        batch, roots, drafting = self.inputs.upload(slots, starts, [r.bonus for r in reqs], flags)
        if plan is not None:
            window = plan.window
        else:
            window = self.max_window if self.method != "ddtree" else 1 + self.round_budget(len(reqs))
        key_len = key_bucket(max(starts) + window, self.cache.max_len)
        captured = self.graphs.get(len(reqs), key_len, plan.arm if plan is not None else None)
        sampling = SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs], self.device,
                                       self.sampling_inputs)
        with self.clock.stage("verify"):
            state = captured.run_forward(batch.slots, batch.starts, roots, batch.first, drafting)
            spec = state["spec"]
            picks = pick(state["logits"], sampling, state["positions"] + 1, spec.depth_bound + 1)
        with self.clock.stage("commit"):
            out = captured.run_commit(picks)
            scores = self.round_logprobs(state["logits"], out["path"], out["tokens"], reqs, sampling)
            counts, emitted, logprobs, paths = self.read_round(out["num_nodes"], out["tokens"], reqs, scores,
                                                               out.get("codes"))
            counts, emitted, logprobs = counts[:real], emitted[:real], logprobs[:real]
            self.cache.advance(batch, counts)
            if self.drafter is not None:
                self.draft_cache.advance(batch, counts)
            elif self.mtp is not None:
                self.mtp.advance(batch, counts)
        if plan is None:
            self.last_plan = self.fixed_round_plan(len(reqs), real)
            return emitted, dict(self.clock.seconds), logprobs
        self.last_plan = plan
        self.time_round(plan, reqs[:real], counts, start, (0.0, 0), paths)
        return emitted, dict(self.clock.seconds), logprobs

    # ---- the plan: who drafts, and how ----------------------------------------------------

    def plan(self, reqs: list[Request]) -> RoundPlan:
        # (A slot's held-back context is set when it is seated: empty, or its source's.)
        if self.policy is not None:
            return self.policy.plan(reqs)
        return self.fixed_round_plan(len(reqs))

    def fixed_round_plan(self, rows: int, real: int | None = None) -> RoundPlan:
        """A fixed method's plan for `real` of a round's `rows` rows (all by default), at the budget of `rows`."""
        if self.mtp is not None:  # every row verifies the head's chain of k drafts
            return fixed_plan(real or rows, "dflash", self.block_size, 0)
        method = self.method if self.drafter is not None else "ar"
        return fixed_plan(real or rows, method, self.block_size, self.round_budget(rows))

    def stage(self, plan: RoundPlan, reqs: list[Request]) -> tuple[dict[str, Tensor], dict[int, list[int]]]:
        """Upload the plan's index lists in one copy."""
        slots = [r.slot for r in reqs]
        longs: dict[str, list[int]] = {}
        rows = plan.draft_rows
        if plan.drafting and rows != list(range(len(slots))):
            longs["draft_rows"] = rows
            longs["draft_slots"] = [slots[i] for i in rows]
            longs["draft_starts"] = [self.cache.lengths[slots[i]] for i in rows]
        flush: dict[int, list[int]] = {}
        if self.deferred is not None:
            idle = [i for i, m in enumerate(plan.modes) if m == AR and not self.plain[slots[i]]]
            flush = self.deferred.groups(self.deferred.due([slots[i] for i in rows], [slots[i] for i in idle]))
            for n, group in flush.items():
                longs[f"held{n}"] = group
                longs[f"held{n}_starts"] = [self.draft_cache.lengths[s] for s in group]
            if idle and plan.drafting:  # all AR: the round's inputs carry the ring rows
                longs["idle_rows"] = idle
                longs["idle_slots"] = [slots[i] for i in idle]
                starts = [self.cache.lengths[slots[i]] for i in idle]
                longs["idle_ring"] = self.deferred.rows(longs["idle_slots"], starts)
        return self.staging.upload(longs), flush

    def append_held(self, flush: dict[int, list[int]], staged: dict[str, Tensor]) -> None:
        """Give the drafter the context it was spared while these slots did not draft."""
        for n, group in flush.items():
            batch = SlotBatch(group, [self.draft_cache.lengths[s] for s in group], staged[f"held{n}"],
                              staged[f"held{n}_starts"])
            ctx = ForwardContext.block(self.draft_cache, batch, n)
            self.drafter.add_context(ctx, self.deferred.held(batch.slots, batch.starts, n))
            self.draft_cache.commit(ctx, [n] * len(group))
            self.deferred.emptied(group)

    def _draft_batch(self, batch: SlotBatch, plan: RoundPlan, staged: dict[str, Tensor]) -> SlotBatch:
        if "draft_rows" not in staged:
            return batch
        slots = [batch.slot_list[i] for i in plan.draft_rows]
        return SlotBatch(slots, [batch.start_list[i] for i in plan.draft_rows], staged["draft_slots"],
                         staged["draft_starts"])

    def draft(self, batch: SlotBatch, roots: Tensor, plan: RoundPlan, staged: dict[str, Tensor]) -> TreeSpec:
        """The round's window: drafted rows from the drafter (only those), the rest a lone root."""
        if self.mtp is not None:
            with self.clock.stage("draft"):
                return self.mtp.draft(batch, roots)
        if not plan.drafting:
            return chain_spec(roots[:, None])
        sub = self._draft_batch(batch, plan, staged)
        sub_roots = roots.index_select(0, staged["draft_rows"]) if "draft_rows" in staged else roots
        with self.clock.stage("draft"):
            t0 = time.perf_counter()
            _, logits, markov = self.draft_pass(sub, sub_roots, plan.depth, self.key_len(sub, 0))
            if self.clock.sync:
                torch.cuda.synchronize()
            self._draft_pass = time.perf_counter() - t0
        with self.clock.stage("tree"):
            part = self.build(sub_roots, logits, markov, plan.budget if plan.tree_rows else 0)
            if plan.tree_rows:
                part = self.static_depth(part, min(logits.shape[1], plan.budget))
            if "draft_rows" not in staged:
                return part
            return place_rows(root_only(roots, plan.window), staged["draft_rows"], part)

    def static_depth(self, spec: TreeSpec, bound: int) -> TreeSpec:
        """With static shapes, the tree's depth bound is the drafted one: a builder may stop early
        (fewer depths than drafted), and a captured round's mask and walk shapes follow the bound,
        so it must not vary. Any bound >= the true depth gives the same result."""
        return dataclasses.replace(spec, max_depth=bound) if self.static else spec

    # ---- what the policy learns from ------------------------------------------------------

    def learn(self, plan: RoundPlan, slots: list[int], counts: list[int], seconds: float,
              held: tuple[float, int] = (0.0, 0), paths: list[list[int]] | None = None) -> None:
        """Fold in a round: its accepted tokens (per tree size, from a tree round's path codes) and
        its seconds, less those of appending held-back drafter context (held: seconds, tokens),
        which the AR steps that parked it cost, not this round's arm."""
        measured = [by_size(paths[i], self.policy.grid[: plan.measure]) for i in plan.draft_rows] \
            if plan.measure else None
        seconds -= held[0]
        self.policy.observe(plan, slots, [c - 1 for c in counts], measured, seconds,
                            1 if plan.drafting else AR_TIMED_EVERY)
        if self.policy.rounds % (DRAFT_REFINE_EVERY if plan.drafting else AR_REFINE_EVERY):
            return  # a sample of the rounds keeps the model current
        s = self.clock.seconds
        stages = {"verify": s.get("verify", 0.0), "draft_pass": self._draft_pass, "tree": s.get("tree", 0.0)}
        cost = self.policy.cost
        cost.refine(len(slots), plan.window, plan.drafting, plan.depth, plan.tree_rows, plan.budget,
                    stages if self.timed_stages and self.graphs is None else None, seconds, keys=plan.keys,
                    sampled=plan.sampled)
        # Keep what this run learned for the next start, under start-up's rule over the timed rounds:
        # refinements learned beside another job would price every later start.
        if cost.refined == SAVE_AFTER and quiet(self.device, self._timed[1], self._timed[0]):
            save(self.cost_path, self.cost_key, cost)

    def round_logprobs(self, logits: Tensor, path: Tensor, tokens: Tensor, reqs: list[Request],
                       sampling: SamplingBatch) -> Tensor | None:
        """[R, A * (1 + 2k)]: the emitted tokens' logprobs and top-k at the accepted path's nodes
        (whose verify logits gave those tokens), when some request keeps logprobs."""
        keep = [r for r in reqs if r.logprobs is not None]
        if not keep:
            return None
        k = max(r.params.logprobs or 0 for r in keep)
        return pack(processed_logprobs(gather_nodes(logits, path), sampling), tokens, k).flatten(1)

    def read_round(self, num_nodes: Tensor, tokens: Tensor, reqs: list[Request], scores: Tensor | None = None,
                   codes: Tensor | None = None
                   ) -> tuple[list[int], list[list[int]], list[list[TokenLogprob] | None], list[list[int]] | None]:
        """The round's one device-to-host read: accepted counts and tokens (and the accepted
        path's codes for the policy), and riding along in float64 (which holds every token id
        exactly) the logprobs."""
        A = tokens.shape[1]
        packed = torch.cat([num_nodes[:, None], tokens] + ([codes] if codes is not None else []), dim=1)
        w = packed.shape[1]
        if scores is None:
            host = packed.tolist()
            rest = [[] for _ in host]
        else:
            rows = torch.cat([packed.double(), scores.double()], 1).tolist()
            host = [[int(x) for x in row[:w]] for row in rows]
            rest = [row[w:] for row in rows]
        counts = [row[0] for row in host]
        emitted = [row[1 : 1 + row[0]] for row in host]
        paths = [row[1 + A :] for row in host] if codes is not None else None
        logprobs: list[list[TokenLogprob] | None] = [None] * len(reqs)
        if scores is not None:
            width = (scores.shape[1] // tokens.shape[1] - 1) // 2
            logprobs = [unpack(row, toks, r.params.logprobs or 0, width) if r.logprobs is not None else None
                        for r, row, toks in zip(reqs, rest, emitted)]
        return counts, emitted, logprobs, paths

    def extend_context(self, plan: RoundPlan, staged: dict[str, Tensor], batch: SlotBatch, features: Tensor,
                       walk, counts: list[int], slots: list[int], ring_rows: Tensor | None = None) -> None:
        """The accepted nodes' features into the drafter's context: appended now for rows that
        drafted, held back (DeferredContext) for rows that took a plain AR step (ring_rows: their
        ring rows, uploaded with the round's inputs when every row did)."""
        if plan.drafting:
            if "draft_rows" in staged:
                rows = staged["draft_rows"]
                sub = self._draft_batch(batch, plan, staged)
                feats, path = features.index_select(0, rows), walk.path.index_select(0, rows)
                kept = [counts[i] for i in plan.draft_rows]
            else:
                sub, feats, path, kept = batch, features, walk.path, counts
            dctx = self._append(sub, feats, path, self.key_len(sub, 0))
            self.draft_cache.commit(dctx, kept)  # rows past len(kept) pad the batch: dropped
        if self.deferred is not None and AR in plan.modes:
            if "idle_rows" in staged:
                idle = [slots[i] for i, m in enumerate(plan.modes) if m == AR and not self.plain[slots[i]]]
                self.deferred.park(idle, staged["idle_ring"], features.index_select(0, staged["idle_rows"])[:, 0])
            elif ring_rows is not None:
                self.deferred.park([s for s in slots if not self.plain[s]], ring_rows, features[:, 0])


def timed(plan: RoundPlan, rounds: int) -> bool:
    """Whether a round under budget="auto" is timed, and so observed: every drafting round, a sample of AR ones."""
    return bool(plan.drafting) or rounds % AR_TIMED_EVERY == 0


def budget_cap(max_round_tokens: int, rows: int) -> int:
    """The most drafted nodes a row's tree may have for a batch of `rows` to fit max_round_tokens."""
    return max(1, max_round_tokens // rows - 1)


def lifetime_rows(req: Request, running: list[Request]) -> int:
    """The batch a request being seated is expected to run in: each of `running` (itself included)
    counts for the share of its output the other may overlap, by their max_tokens (a batch shrinks
    to a tail of its longest requests, where drafting pays more)."""
    mine = max(1, req.params.max_tokens - len(req.output_ids))
    return max(1, round(sum(min(max(0, r.params.max_tokens - len(r.output_ids)), mine) for r in running) / mine))


def selector_on(drafter: DFlashDrafter | None, wanted: bool | None) -> bool:
    """Draft with the candidate selector (a Markov draft) when the drafter has one, unless turned off."""
    has = isinstance(drafter, DFlash2Drafter)
    if wanted and not has:
        raise FlashtreeError("use_selector=True needs a DFlash2 drafter (architectures DFlash2DraftModel); "
                             "this drafter has no candidate selector")
    return has and wanted is not False


def padding_request(slot: int) -> Request:
    """A greedy row at `slot` whose round keeps nothing: the dummy slot's rows that fill a batch bucket,
    and the rows start-up times whole rounds with (time_rounds)."""
    req = Request([0], SamplingParams(), request_id="padding")
    req.slot, req.bonus = slot, 0
    return req


def path_codes(spec: TreeSpec, path: Tensor) -> Tensor:
    """[R, A] int64: per accepted node (path as from accept_walk), 4 x its rank in the tree's
    order, + 2 where it has a child in the tree, + 1 where it is its parent's best child; -1 past
    the path. Read with the round, they give on the host what every smaller tree and the chain
    of best children would have accepted, or that the chain's walk ran past the tree's spine
    (policy.by_size): a scatter and two gathers, where the same on the device took a sort and
    a dozen scatters, about 0.15 ms of a 16 ms round on the demo pair at c = 4."""
    R, N = spec.tokens.shape
    real = (spec.tokens >= 0) & (torch.arange(N, device=path.device) > 0)
    children = torch.zeros(R, N, dtype=torch.long, device=path.device).scatter_add_(
        1, spec.parents.expand(R, N).clamp(min=0), real.long())
    code = (spec.ranks * 4 + (children > 0) * 2 + spec.first).gather(1, path.clamp(min=0))
    return torch.where(path >= 0, code, -1)


def gather_nodes(x: Tensor, path: Tensor) -> Tensor:
    """Rows of x [R, N, F] at node indices path [R, A] (padding -1 reads node 0)."""
    idx = path.clamp(min=0)[:, :, None].expand(-1, -1, x.shape[-1])
    return x.gather(1, idx)
