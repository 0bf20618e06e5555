import os
import sys
from pathlib import Path

import torch

# Tests are small; one thread keeps them deterministic and leaves the other core free.
torch.set_num_threads(int(os.environ.get("FLASHTREE_TEST_THREADS", "1")))
sys.path.insert(0, str(Path(__file__).parent))

# budget="auto" caches its measured round costs on disk; keep the tests' out of the user's home.
if "FLASHTREE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["FLASHTREE_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashtree-test-cache-")
