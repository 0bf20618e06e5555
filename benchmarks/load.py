"""Load test for `flashtree serve`: N streamed requests at concurrency c, over loopback HTTP.

    python benchmarks/load.py --methods ar dflash ddtree --concurrency 1 4 16 --requests 32

Without --url it starts one server per method itself (a `flashtree serve` subprocess on a
free 127.0.0.1 port), waits for /health, measures, and stops it with SIGTERM. With --url it
measures that server as it is (--methods then only labels the rows).

Per (method, concurrency) it prints output tokens/s (all requests' completion tokens over
the wall time of the whole batch), mean request latency, mean time to first token, and the
mean acceptance length tau read from the server's /metrics over that run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

def load_prompts(suite: str) -> list[str | list[int]]:
    """A bench suite's prompts (text or token ids); "all" = the project's code + prose suites."""
    from flashtree.bench.suites import BUILTIN, load_suite

    suites = BUILTIN if suite == "all" else (suite,)
    return [p.text if p.text is not None else p.token_ids for name in suites for p in load_suite(name)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def spawn_server(args: argparse.Namespace, method: str):
    """A `flashtree serve` subprocess for one method; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "flashtree.cli", "serve", "--method", method, "--budget", str(args.budget),
           "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(args.max_batch),
           "--log-level", "warning"]
    for flag in ("target", "drafter", "device", "dtype", "max_model_len"):
        value = getattr(args, flag)
        if value is not None and not (flag == "drafter" and method == "ar"):
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not become healthy within 600 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def accept_stats(url: str) -> tuple[float, float]:
    """(sum, count) of the server's accept-length histogram."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    get = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    return get("flashtree_accept_length_sum"), get("flashtree_accept_length_count")


async def one(http: httpx.AsyncClient, url: str, model: str, prompt: str | list[int], args) -> tuple[float, float, int]:
    """Stream one completion; returns (latency, time to first token, completion tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"request failed with {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"stream error: {chunk['error']}")
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - t0
            if chunk.get("usage") and not chunk["choices"]:
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - t0
    return latency, latency if first is None else first, tokens


async def run_load(url: str, model: str, prompts: list, concurrency: int, args) -> dict:
    todo = [prompts[i % len(prompts)] for i in range(args.requests)]
    results: list[tuple[float, float, int]] = []

    async def worker(http):
        while todo:
            results.append(await one(http, url, model, todo.pop(), args))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(http) for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
            "mean_latency_s": sum(r[0] for r in results) / len(results),
            "mean_ttft_s": sum(r[1] for r in results) / len(results)}


def measure(url: str, method: str, args) -> list[dict]:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    prompts = load_prompts(args.suite)
    # Warm-up (first-call allocations, CUDA context): not measured.
    asyncio.run(run_load(url, model, prompts, 1, argparse.Namespace(**{**vars(args), "requests": 1})))
    rows = []
    for c in args.concurrency:
        s0, n0 = accept_stats(url)
        row = asyncio.run(run_load(url, model, prompts, c, args))
        s1, n1 = accept_stats(url)
        row.update(method=method, concurrency=c, tau=(s1 - s0) / max(1.0, n1 - n0))
        rows.append(row)
        print(f"| {method} | {c} | {row['requests']} | {row['tokens']} | {row['tok_per_s']:.1f} | "
              f"{row['mean_latency_s']:.2f} | {row['mean_ttft_s']:.3f} | {row['tau']:.2f} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="measure a running server instead of starting one")
    p.add_argument("--methods", nargs="+", default=["ddtree"], help="ar, dflash, ddtree (one server each)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (default: ignore it, so every request generates max-tokens)")
    p.add_argument("--suite", default="all", help="a bench suite (code, prose, a .jsonl file) or all = code + prose")
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--budget", default="64", help="ddtree tree budget: an integer or 'auto'")
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--json", help="also write all rows to this file")
    args = p.parse_args(argv)
    print("| method | concurrency | requests | output tokens | output tok/s | mean latency s | mean TTFT s | tau |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for method in args.methods:
        label = f"{method} B={args.budget}" if method == "ddtree" and not args.url else method
        if args.url:
            rows += measure(args.url.rstrip("/"), label, args)
        else:
            with spawn_server(args, method) as url:
                rows += measure(url, label, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
