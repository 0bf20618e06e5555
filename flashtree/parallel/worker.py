"""`python -m flashtree.parallel.worker --rank R ...`: one tensor-parallel worker, started by
rank 0 (flashtree.parallel.workers.start_worker), never by hand.

Everything it needs comes on the command line (rank, world size, the rendezvous port, the
inherited control socket, device, threads), so it imports flashtree alone and nothing of the
script that rank 0 runs.
"""

from __future__ import annotations

import argparse
import logging


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flashtree.parallel.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="rank 0's TCPStore (the rendezvous)")
    p.add_argument("--fd", type=int, required=True, help="the control socket rank 0 passed down")
    p.add_argument("--device", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--check", action="store_true", help="FLASHTREE_TP_CHECK: send a digest after every call")
    args = p.parse_args(argv)
    logging.getLogger("flashtree").setLevel(logging.ERROR)  # rank 0 logs the same warnings; errors still show

    import torch

    from flashtree.parallel.workers import Channel, worker_main

    worker_main(args.rank, args.world, args.port, Channel(args.fd), torch.device(args.device), args.threads,
                args.check)


if __name__ == "__main__":
    main()
