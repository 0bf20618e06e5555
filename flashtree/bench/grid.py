"""Run the bench grid: methods x budgets over suites x temperatures, one request at a time.

The weights load once; every grid cell is its own LLMEngine (own KV caches, own method and
budget) sharing the loaded modules (LLMEngine(share_weights=...)). Cells are interleaved per
prompt, in an order rotated from prompt to prompt, so drift (thermal, other processes on the
box) spreads over all methods instead of landing on whichever ran last. Every cell runs warmup
requests first; they are not recorded.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from flashtree.bench.cost import CostCurve, curve_sizes, measure_cost_curve
from flashtree.bench.metrics import CellSummary, RequestRecord, compare_to_ar, match_fraction, summarize
from flashtree.bench.suites import Prompt, load_suite
from flashtree.config import DEMO_DRAFTER, MAX_SPECULATIVE_TOKENS, METHODS, EngineConfig
from flashtree.engine import LLMEngine
from flashtree.errors import FlashtreeError
from flashtree.sampling import SamplingParams

DEFAULT_BUDGETS: list[int | str] = [4, 8, 16, 32, 64, 128, 256, 512, 1024, "auto"]


@dataclass
class BenchSpec:
    """What to measure. Engine fields mirror EngineConfig; the rest shapes the grid."""

    target: str | None = None
    drafter: str | None = None
    device: str | None = None
    dtype: str | None = None
    tensor_parallel_size: int = 1
    use_selector: bool | None = None  # DFlash2 drafters: False benches the marginal tree
    mtp_head: str | None = None  # mtp cells' head: None = the target's own (the demo target: its trained head)
    num_speculative_tokens: list[int] = field(default_factory=lambda: [3])  # one mtp cell per k
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    budgets: list[int | str] = field(default_factory=lambda: list(DEFAULT_BUDGETS))  # ints, or "auto"
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    suites: list[str] = field(default_factory=lambda: ["code", "prose"])
    max_tokens: int = 128
    num_prompts: int = 10
    warmup: int = 1  # unrecorded requests per cell and temperature
    seed: int = 0
    ignore_eos: bool = False
    stage_sync: bool = True  # sync the device between stages so each stage owns its GPU time
    cost_repeats: int = 5
    cost_dense: bool = True  # 1.5x points between the powers of two
    cost_context: int | None = None  # None: median prompt + max_tokens / 2
    compile: bool = False  # every cell's engine with compile=True (cpu: compiled layers; cuda: captured rounds)
    pack_weights: bool | None = None  # cpu: oneDNN's packed linear weights (None: where they fit)

    def validate(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise FlashtreeError(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
        if "ddtree" in self.methods and not self.budgets:
            raise FlashtreeError("ddtree needs at least one budget (--budgets 16,64)")
        if any(b != "auto" and not (isinstance(b, int) and 1 <= b <= 1024) for b in self.budgets):
            raise FlashtreeError(f"budgets must be integers in 1..1024 or 'auto', got {self.budgets}")
        if "mtp" in self.methods and (not self.num_speculative_tokens
                                      or any(not 1 <= k <= MAX_SPECULATIVE_TOKENS for k in self.num_speculative_tokens)):
            raise FlashtreeError(f"--num-speculative-tokens must be integers in 1..{MAX_SPECULATIVE_TOKENS}, "
                                 f"got {self.num_speculative_tokens}")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise FlashtreeError(f"temperatures must be >= 0, got {self.temperatures}")
        if self.max_tokens < 1 or self.num_prompts < 1 or self.warmup < 0 or self.cost_repeats < 1:
            raise FlashtreeError("max_tokens, num_prompts and cost_repeats must be >= 1, warmup >= 0")
        if not self.suites:
            raise FlashtreeError("give at least one suite")

    @property
    def fixed_budgets(self) -> list[int]:
        return sorted({b for b in self.budgets if b != "auto"})


@dataclass(frozen=True)
class Cell:
    method: str
    budget: int | str | None = None  # ddtree: an int or "auto"; mtp: the drafted tokens k

    @property
    def label(self) -> str:
        return f"{self.method}-{self.budget}" if self.method in ("ddtree", "mtp") else self.method


def grid_cells(methods: list[str], budgets: list[int | str], mtp_k: list[int] = (3,)) -> list[Cell]:
    """ar first (the baseline), mtp by k (what users run today), then dflash, then ddtree by budget,
    "auto" last."""
    cells = [Cell("ar")] if "ar" in methods else []
    cells += [Cell("mtp", k) for k in sorted(set(mtp_k))] if "mtp" in methods else []
    cells += [Cell(m) for m in METHODS if m in methods and m not in ("ar", "mtp", "ddtree")]
    if "ddtree" in methods:
        cells += [Cell("ddtree", b) for b in sorted({b for b in budgets if b != "auto"})]
        cells += [Cell("ddtree", "auto")] if "auto" in budgets else []
    return cells


@dataclass
class BenchResult:
    spec: BenchSpec
    suites: list[str]  # short names, in order
    cells: list[CellSummary]
    records: dict[tuple[str, float, str], list[RequestRecord]]  # (suite, temperature, label)
    cost: CostCurve
    block_size: int
    prompt_tokens: dict[str, list[int]]  # suite -> prompt lengths
    device: str
    dtype: str
    seconds: float
    load_average_start: list[float] | None = None  # 1/5/15-min load when the run began (shared boxes)
    models: dict = field(default_factory=dict)  # which checkpoints ran: directory + weights digest


def _engine_config(spec: BenchSpec, method: str, budget: int | str | None, max_model_len: int | None) -> EngineConfig:
    # No prefix reuse: every pass runs the same prompts, and each should pay its prefill alike.
    mtp = method == "mtp"
    return EngineConfig(target=spec.target, drafter=None if mtp else spec.drafter, method=method,
                        budget=64 if mtp else budget or 64, num_speculative_tokens=budget if mtp else 3,
                        mtp_head=spec.mtp_head, device=spec.device, dtype=spec.dtype, max_batch=1,
                        max_model_len=max_model_len, stage_timing=spec.stage_sync,
                        tensor_parallel_size=spec.tensor_parallel_size, prefix_cache=False,
                        use_selector=spec.use_selector, compile=spec.compile,
                        pack_weights=spec.pack_weights)


def encode_prompt(engine: LLMEngine, prompt: Prompt) -> list[int]:
    """Token ids as the engine would see them; instructions go through the chat template if any."""
    if prompt.token_ids is not None:
        return engine.encode(prompt.token_ids)
    tok = engine.tokenizer
    if prompt.chat and tok is not None and getattr(tok, "chat_template", None):
        return engine.encode(engine.encode_chat([{"role": "user", "content": prompt.text}]))
    return engine.encode(prompt.text)


def run_request(engine: LLMEngine, prompt_id: str, ids: list[int], params: SamplingParams) -> RequestRecord:
    req = engine.add_request(ids, params)
    while not req.finished:
        engine.step()
    s = req.stats
    return RequestRecord(prompt_id, len(ids), len(req.output_ids), s.wall_seconds, list(s.accept_lengths),
                         dict(s.stage_seconds), req.finish_reason or "", list(req.output_ids))


def load_prompts(spec: BenchSpec) -> dict[str, list[Prompt]]:
    """Suites keyed by short name (a .jsonl path becomes its stem); loaded before any weights,
    so a bad suite fails fast."""
    prompts: dict[str, list[Prompt]] = {}
    for name in dict.fromkeys(spec.suites):
        ps = load_suite(name, spec.num_prompts)
        if ps[0].suite in prompts:
            raise FlashtreeError(f"two suites are both called {ps[0].suite!r}; rename one of the files")
        prompts[ps[0].suite] = ps
    return prompts


def engine_cost_curve(engine: LLMEngine, *args, **kwargs) -> CostCurve:
    """measure_cost_curve on an engine's loaded models (LLMEngine.on_every_rank calls it by name)."""
    return measure_cost_curve(engine.target, engine.drafter, *args, **kwargs)


@dataclass
class Loaded:
    base: LLMEngine  # the engine that loaded the weights; the cells share them
    engines: dict[Cell, LLMEngine]
    ids: dict[str, list[list[int]]]  # suite -> prompt token ids (tail-truncated to fit)
    target: object
    drafter: object
    limit: int  # the target's usable context
    models: dict  # checkpoint ids, taken when the weights were read


def build_engines(spec: BenchSpec, cells: list[Cell], prompts: dict[str, list[Prompt]]) -> Loaded:
    """Load the weights once, tokenise, then one engine per cell sized to the run's longest request."""
    drafting = any(c.method in ("dflash", "ddtree") for c in cells)
    if drafting and spec.target is None and spec.drafter is None and not DEMO_DRAFTER.is_dir():
        raise FlashtreeError(f"the demo drafter is not there yet ({DEMO_DRAFTER}); pass --drafter, "
                             "or measure the target alone with --methods ar")
    base = LLMEngine(_engine_config(spec, "ddtree" if drafting else "ar", max(spec.fixed_budgets, default=64), None))
    limit = base.config.max_model_len
    room = limit - spec.max_tokens - 1
    if room < 1:
        raise FlashtreeError(f"--max-tokens {spec.max_tokens} leaves no room for a prompt in {limit} positions")
    # Over-long prompts keep their tail: the continuation is what the bench is about.
    ids = {s: [encode_prompt(base, p)[-room:] for p in ps] for s, ps in prompts.items()}
    need = min(limit, max(len(x) for xs in ids.values() for x in xs) + spec.max_tokens + 1)
    engines: dict[Cell, LLMEngine] = {}
    for c in cells:  # mtp cells share the first one's head
        heads = [e for cell, e in engines.items() if cell.method == "mtp"]
        share = heads[0] if c.method == "mtp" and heads else base
        engines[c] = LLMEngine(_engine_config(spec, c.method, c.budget, need), share_weights=share)
    # Digest the weights now, right after reading them: a checkpoint replaced during the run
    # must not be credited with the run's numbers.
    models = {"target": checkpoint_id(base.target)}
    if base.drafter is not None:
        models["drafter"] = checkpoint_id(base.drafter)
    heads = [e.drafter for c, e in engines.items() if c.method == "mtp"]
    if heads:
        models["mtp_head"] = checkpoint_id(heads[0])
    return Loaded(base, engines, ids, base.target, base.drafter, limit, models)


def measure_grid(spec: BenchSpec, cells: list[Cell], prompts: dict[str, list[Prompt]], loaded: Loaded,
                 progress: bool) -> dict[tuple[str, float, str], list[RequestRecord]]:
    """Warm every cell up, then run each prompt through every cell (order rotated per prompt)."""
    ids, engines = loaded.ids, loaded.engines
    first = next(iter(ids.values()))[0]
    bar = tqdm(total=len(cells) * len(spec.temperatures) * (spec.warmup + sum(map(len, ids.values()))),
               desc="bench", unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    for cell, engine in engines.items():
        for t in spec.temperatures:
            for _ in range(spec.warmup):
                bar.set_postfix_str(f"warmup {cell.label}", refresh=False)
                warm = SamplingParams(temperature=t, max_tokens=min(16, spec.max_tokens), seed=spec.seed)
                run_request(engine, "warmup", first, warm)
                bar.update(1)
    records: dict[tuple[str, float, str], list[RequestRecord]] = {}
    for t in spec.temperatures:
        for suite, ps in prompts.items():
            for i, (prompt, x) in enumerate(zip(ps, ids[suite])):
                params = SamplingParams(temperature=t, max_tokens=spec.max_tokens, seed=spec.seed + i,
                                        ignore_eos=spec.ignore_eos)
                k = i % len(cells)
                for cell in cells[k:] + cells[:k]:
                    bar.set_postfix_str(f"T={t:g} {suite} {cell.label}", refresh=False)
                    rec = run_request(engines[cell], prompt.id, x, params)
                    records.setdefault((suite, t, cell.label), []).append(rec)
                    bar.update(1)
    bar.close()
    return records


def measure_cost(spec: BenchSpec, cells: list[Cell], loaded: Loaded, block_size: int, progress: bool) -> CostCurve:
    """The verify cost curve at the run's typical context (median prompt + half the output)."""
    lengths = [len(x) for xs in loaded.ids.values() for x in xs]
    # Spans every requested budget even when ddtree is not run: an ar-only run still shows
    # what trees would cost.
    max_nodes = max([b + 1 for b in spec.fixed_budgets] + [block_size])
    context = spec.cost_context or int(statistics.median(lengths)) + spec.max_tokens // 2
    context = max(1, min(context, loaded.limit - max_nodes))
    tree_sizes = curve_sizes(max_nodes, spec.fixed_budgets, spec.cost_dense)
    chain_sizes = sorted({1} | ({block_size} if any(c.method == "dflash" for c in cells) else set())
                         | {int(c.budget) + 1 for c in cells if c.method == "mtp"})
    bar = tqdm(total=(len(tree_sizes) + len(chain_sizes)) * spec.cost_repeats, desc="cost curve", unit="fwd",
               file=sys.stderr, disable=not progress, dynamic_ncols=True)
    # Through the engine: under tensor parallelism every rank runs the sharded forwards together.
    cost = loaded.base.on_every_rank(engine_cost_curve, tree_sizes, chain_sizes, context, spec.temperatures,
                                     spec.cost_repeats, rank0_kwargs=dict(progress=lambda: bar.update(1)))
    bar.close()
    return cost


def run_bench(spec: BenchSpec, progress: bool = True) -> BenchResult:
    spec.validate()
    t_start = time.perf_counter()
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    prompts = load_prompts(spec)
    cells = grid_cells(spec.methods, spec.budgets, spec.num_speculative_tokens)
    loaded = build_engines(spec, cells, prompts)
    block_size = loaded.drafter.block_size if loaded.drafter is not None else 1
    records = measure_grid(spec, cells, prompts, loaded, progress)
    cost = measure_cost(spec, cells, loaded, block_size, progress)
    suites = list(prompts)
    summaries = summarize_all(suites, spec.temperatures, cells, records, block_size)
    compare_to_ar(summaries, cost.verify_ms)
    engine = next(iter(loaded.engines.values()))
    return BenchResult(spec, suites, summaries, records, cost, block_size,
                       {s: [len(x) for x in xs] for s, xs in loaded.ids.items()}, str(engine.device),
                       str(engine.dtype).removeprefix("torch."), time.perf_counter() - t_start, load_start, loaded.models)


def checkpoint_id(module) -> dict:
    """Where a loaded model came from and a digest of its weights, so a result names its checkpoint
    (the demo pair is retrained from time to time)."""
    src = getattr(module, "source_dir", None)
    if src is None:
        return {"path": None, "sha256": None}
    digest = hashlib.sha256()
    for f in sorted(Path(src).glob("*.safetensors")):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return {"path": str(src), "sha256": digest.hexdigest()[:16]}


def tree_nodes(cell: Cell, block_size: int) -> int | None:
    """Nodes the target verifies per round: the root alone, the DFlash block, the MTP chain, or
    budget + root (None for "auto", whose size changes from round to round)."""
    if cell.method == "mtp":
        return int(cell.budget) + 1
    if cell.method == "ddtree":
        return None if cell.budget == "auto" else int(cell.budget) + 1
    return {"ar": 1, "dflash": block_size}[cell.method]


def summarize_all(suites: list[str], temperatures: list[float], cells: list[Cell], records: dict,
                  block_size: int) -> list[CellSummary]:
    """One summary per (suite, temperature, cell); with several suites, also suite "all" (pooled)."""
    out = []
    for t in temperatures:
        for suite in suites + (["all"] if len(suites) > 1 else []):
            for cell in cells:
                if suite == "all":
                    recs = [r for s in suites for r in records[(s, t, cell.label)]]
                    ar = [r for s in suites for r in records.get((s, t, "ar"), [])]
                else:
                    recs = records[(suite, t, cell.label)]
                    ar = records.get((suite, t, "ar"), [])
                c = summarize(suite, t, cell.method, cell.budget, tree_nodes(cell, block_size), recs, block_size)
                if t == 0 and ar and cell.method != "ar":
                    c.matches_ar = match_fraction(recs, ar) if suite != "all" else _pooled_match(suites, t, cell, records)
                out.append(c)
    return out


def _pooled_match(suites: list[str], t: float, cell: Cell, records: dict) -> float:
    """Prompt ids may repeat across suites, so pool the per-suite matches."""
    hits = total = 0
    for s in suites:
        recs = records[(s, t, cell.label)]
        hits += match_fraction(recs, records[(s, t, "ar")]) * len(recs)
        total += len(recs)
    return hits / max(1, total)
