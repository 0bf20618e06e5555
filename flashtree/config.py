"""Engine configuration: what to run, how big, and where. Validated once, up front."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flashtree.errors import FlashtreeError

METHODS = ("ar", "dflash", "ddtree", "mtp")
DEMO_DIR = Path(__file__).parent / "assets" / "demo"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFTER = DEMO_DIR / "drafter"  # DFlash2 (candidate selector); see its recipe.json
DEMO_DRAFTER_DFLASH1 = DEMO_DIR / "drafter-dflash1"  # the earlier DFlash-1 drafter, kept for comparison
DEMO_MTP = DEMO_DIR / "mtp"  # an MTP head for the demo target (method="mtp"); see its recipe.json
MAX_SPECULATIVE_TOKENS = 32


def looks_like_hub_id(name: str) -> bool:
    """`owner/name`, as opposed to a local path (which need not exist yet to be meant as one)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


@dataclass
class EngineConfig:
    target: str | None = None  # HF dir or hub id; None = the embedded demo target
    drafter: str | None = None  # z-lab DFlash dir or hub id; None = the demo drafter (demo target only)
    method: str = "ddtree"
    # "auto": each round and request, the speculation policy picks a plain AR step, the chain or a
    # tree of the right size from measured costs and calibrated acceptance (flashtree/engine/policy.py);
    # an int: that many drafted tree nodes per request and round (root not counted).
    budget: int | str = "auto"
    max_budget: int = 256  # the largest tree budget="auto" may choose
    cost_cache: str | None = None  # auto's measured costs: a directory, "off", or None (~/.cache/flashtree)
    device: str | None = None  # None = cuda if available, else cpu
    dtype: str | None = None  # None/auto = bf16 on cuda, float32 on cpu
    max_batch: int = 8  # requests decoded together
    max_model_len: int | None = None  # prompt + output; None = min(target's limit, 4096)
    allow_long_max_model_len: bool = False  # allow max_model_len above the target's max_position_embeddings
    max_round_tokens: int = 4096  # cap on all trees' nodes in one batched verify
    max_queue: int = 256  # waiting requests before add_request refuses
    stage_timing: bool | None = None  # sync between stages to time them; None = on for cpu only
    max_prefill_tokens: int = 512  # prompt tokens prefilled per engine step (a long prompt goes in chunks)
    prefix_cache: bool = True  # reuse the K/V of a prompt prefix some cache slot already holds
    tensor_parallel_size: int = 1  # ranks the target is split over (flashtree starts the N - 1 workers)
    use_selector: bool | None = None  # DFlash2 drafters: None = use the selector; False = marginal trees (build_tree)
    # Prepare every shape at start-up, never inside a request. On cuda: capture the rounds, one per
    # (batch bucket, key bucket, and under budget="auto" each arm it may play), and replay them as
    # CUDA graphs. On cpu: compile a dense target's decoder stack and the DFlash drafter's layers with
    # inductor (one graph each, dynamic in rows and window, attention opaque), which every method,
    # auto included, runs.
    compile: bool = False
    # Captured rounds: None = with compile on cuda; True also on cpu, where the rounds replay eagerly
    # through the same static buffers (the tests' stand-in for CUDA graphs).
    capture: bool | None = None
    static_shapes: bool | None = None  # pad every forward to a shape bucket; always on with captured rounds
    # cpu, float32/bfloat16: linear layers multiply through oneDNN's packed weights (a second copy). None =
    # when oneDNN is there and the copies fit in half the free memory; False = PyTorch's F.linear (MKL).
    pack_weights: bool | None = None
    # method="mtp": the MTP head's recursive drafts per round (3, as vLLM and SGLang serve Qwen3.6) ...
    num_speculative_tokens: int = 3
    # ... and where the head is: None = the target's own mtp.* tensors (the demo target: its trained
    # head); else a checkpoint that ships mtp.* tensors or a head from `flashtree train train --mtp`.
    mtp_head: str | None = None

    @property
    def tree_budget(self) -> int:
        """The largest tree a round may build."""
        return self.max_budget if self.budget == "auto" else self.budget

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise FlashtreeError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.budget != "auto" and (not isinstance(self.budget, int) or not 1 <= self.budget <= 1024):
            raise FlashtreeError(f"budget must be an integer in 1..1024 or 'auto', got {self.budget!r}")
        if not 1 <= self.max_budget <= 1024:
            raise FlashtreeError(f"max_budget must be in 1..1024, got {self.max_budget}")
        if self.max_batch < 1:
            raise FlashtreeError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise FlashtreeError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_prefill_tokens < 1:
            raise FlashtreeError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise FlashtreeError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.max_round_tokens < self.max_batch:
            raise FlashtreeError("max_round_tokens must be at least max_batch (one node per request)")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise FlashtreeError(f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
                                 f"got {self.num_speculative_tokens!r}")
        if self.pack_weights not in (None, True, False):
            raise FlashtreeError(f"pack_weights must be True, False or None (pack where the copies fit), "
                                 f"got {self.pack_weights!r}")
        if self.target is None:
            self.target = str(DEMO_TARGET)
            if self.drafter is None and self.method not in ("ar", "mtp"):
                self.drafter = str(DEMO_DRAFTER)
        if self.method == "mtp" and self.mtp_head is None and is_demo_target(self.target):
            self.mtp_head = str(DEMO_MTP)
        if self.method not in ("ar", "mtp") and self.drafter is None:
            raise FlashtreeError(
                f"method {self.method!r} needs a drafter: pass drafter=/--drafter with a DFlash checkpoint, "
                "or use method='ar'"
            )


def is_demo_target(target: str) -> bool:
    path = Path(target).expanduser()
    return path.is_dir() and path.resolve() == DEMO_TARGET.resolve()
