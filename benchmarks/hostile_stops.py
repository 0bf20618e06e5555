"""Does one hostile request stall the others? Latency of ordinary requests and /health, alone and
while hostile stop-string requests stream, over loopback HTTP.

    python benchmarks/hostile_stops.py                                 # 16 stops x 256 chars (the limit)
    python benchmarks/hostile_stops.py --stop-chars 100000 --rounds 1  # the issue's 1.6 MB request

The hostile request is the one the soak test found: a streamed completion of 2,000 token ids
(the target's longest tokens, so the echoed prompt is long text) with `echo: true`,
`max_tokens: 40` and 16 long stop strings (random letters, so none matches and the request
runs its 40 tokens). A server that scanned every prefix of every stop string on
each event stalled everyone; one that refuses stop lists over its limit answers 400 at once.

Without --url it starts a `flashtree serve` subprocess on a free 127.0.0.1 port (the demo pair
by default) and stops it with SIGTERM at the end. Per round it sends --probes ordinary requests
(a non-streamed 16-token completion) and /health probes one after another in three phases:
alone; while the same long request streams back to back without stop strings (what sharing
the engine with a 2,000-token context costs anyway); and while the hostile one does. It prints
the median and worst latency of each, and how the background requests ended.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import time

import httpx
from load import spawn_server


async def timed(coro) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    r = await coro
    return time.perf_counter() - t0, r


async def probe(http: httpx.AsyncClient, url: str, model: str, n: int) -> tuple[list[float], list[float]]:
    """(ordinary request latencies, /health latencies), n of each, one at a time."""
    ordinary, health = [], []
    body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    for _ in range(n):
        seconds, r = await timed(http.post(f"{url}/v1/completions", json=body))
        assert r.status_code == 200, r.text[:300]
        ordinary.append(seconds)
        seconds, r = await timed(http.get(f"{url}/health"))
        health.append(seconds)
    return ordinary, health


async def background(http: httpx.AsyncClient, url: str, model: str, body: dict, stop: asyncio.Event,
                     ends: list) -> None:
    """`body` streamed back to back until `stop`; each one's (status, seconds) goes to `ends`."""
    while not stop.is_set():
        t0 = time.perf_counter()
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines()]
        ends.append((r.status_code, time.perf_counter() - t0))
        if r.status_code != 200:  # refused: sending it again only measures the refusal
            print(f"refused with {r.status_code}: {''.join(lines)[:300]}")
            await stop.wait()


def long_token_ids(target: str | None, n: int) -> list[int]:
    """n token ids cycling over the target's 200 longest tokens, so the echoed prompt is long text
    (a hold-back that rescans the text costs in proportion to it)."""
    from transformers import AutoTokenizer

    from flashtree.config import DEMO_TARGET

    tok = AutoTokenizer.from_pretrained(str(target or DEMO_TARGET))
    ids = sorted(range(len(tok)), key=lambda i: -len(tok.decode([i])))[:200]
    return [ids[i % len(ids)] for i in range(n)]


def bodies(model: str, args) -> dict[str, dict | None]:
    """Each phase's background request: none, the long request without stops, the hostile one."""
    rng = random.Random(0)
    stops = ["".join(rng.choice(string.ascii_letters) for _ in range(args.stop_chars)) for _ in range(args.stops)]
    long = {"model": model, "prompt": long_token_ids(args.target, args.prompt_tokens), "echo": True,
            "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    return {"alone": None, "with the long request, no stops": long, "with the hostile request": {**long, "stop": stops}}


def summary(label: str, values: list[float], base: list[float]) -> str:
    med, worst = statistics.median(values), max(values)
    return f"| {label} | {med * 1e3:.0f} | {worst * 1e3:.0f} | {med / statistics.median(base):.2f}x |"


async def run(url: str, args) -> None:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=args.hostile + 4)) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await probe(http, url, model, 2)  # warm-up
        phases = bodies(model, args)
        probes = {name: ([], []) for name in phases}
        ends: dict[str, list[tuple[int, float]]] = {name: [] for name in phases}
        for _ in range(args.rounds):  # the phases alternate, so drift in the machine's load hits them all
            for name, body in phases.items():
                stop = asyncio.Event()
                tasks = [asyncio.create_task(background(http, url, model, body, stop, ends[name]))
                         for _ in range(args.hostile if body else 0)]
                await asyncio.sleep(args.head_start if body else 0)
                for i, part in enumerate(await probe(http, url, model, args.probes)):
                    probes[name][i].extend(part)
                stop.set()
                await asyncio.gather(*tasks)
    print(f"hostile request: {args.prompt_tokens} token ids, echo, 40 tokens, {args.stops} stop strings of "
          f"{args.stop_chars} characters; {args.hostile} in flight")
    print("| probe | median ms | worst ms | median vs alone |")
    print("|---|---|---|---|")
    for i, what in enumerate(("16-token completion", "/health")):
        for name in phases:
            print(summary(f"{what}, {name}", probes[name][i], probes["alone"][i]))
    for name, ended in ends.items():
        if ended:
            print(f"{name}: {len(ended)} background requests, status {sorted({c for c, _ in ended})}, median "
                  f"{statistics.median(s for _, s in ended) * 1e3:.0f} ms each")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="measure a running server instead of starting one")
    p.add_argument("--stops", type=int, default=16, help="stop strings per hostile request (default 16)")
    p.add_argument("--stop-chars", type=int, default=256, help="characters per stop string (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--hostile", type=int, default=1, help="hostile requests in flight (default 1)")
    p.add_argument("--probes", type=int, default=5, help="ordinary requests per phase and round (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="alone/loaded pairs (default 3)")
    p.add_argument("--head-start", type=float, default=1.0, help="seconds the hostile requests run before probing")
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--budget", default="auto")
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-model-len", type=int)
    args = p.parse_args(argv)
    if args.url:
        asyncio.run(run(args.url.rstrip("/"), args))
        return
    with spawn_server(args, "ddtree") as url:
        asyncio.run(run(url, args))


if __name__ == "__main__":
    main()
