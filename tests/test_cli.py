"""The command line as a new user meets it: one-line errors, --version, python -m flashtree,
--threads, --stop escapes, a prompt from stdin, and `serve`'s startup line and signals."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from flashtree import __version__
from flashtree.cli import default_threads, main, physical_cores, unescape

ROOT = Path(__file__).parent.parent
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `flashtree argv...` in this process."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashtree: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv,words", [
    (["serve", "--port", "99999"], "1..65535"),
    (["serve", "--port", "0"], "1..65535"),
    (["serve", "--port", "-1"], "1..65535"),
    (["serve", "--max-batch", "0"], "positive integer"),
    (["generate", "hi", "--device", "foo"], "unknown device 'foo'"),
    (["generate", "hi", "--target", "/nonexistent/model"], "no such model directory: /nonexistent/model"),
    (["generate", "hi", "--threads", "0"], "positive integer"),
    (["generate"], "required: prompt"),
    (["serve", "--shutdown-timeout", "-1"], "non-negative finite number of seconds, got -1"),
    (["serve", "--read-timeout", "0"], "positive finite number of seconds, got 0"),
    (["serve", "--read-timeout", "inf"], "finite number of seconds"),
])
def test_bad_flags_get_one_line(capsys, argv, words):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and words in one_line_error(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has a GPU")
def test_cuda_on_a_cpu_only_torch(capsys):
    code, _, err = run_cli(capsys, "generate", "hi", "--device", "cuda")
    assert code == 2 and "--device cuda" in one_line_error(err) and "--device cpu" in err


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is available here")
def test_mps_where_there_is_none(capsys):
    code, _, err = run_cli(capsys, "serve", "--device", "mps")
    assert code == 2 and "MPS" in one_line_error(err)


def test_version_and_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "flashtree", "--version"], capture_output=True, text=True, env=ENV,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"flashtree {__version__}"


def test_too_long_prompt_names_a_real_flag_and_prints_nothing_else():
    """A separate process, so a transformers warning printed ahead of the error would show."""
    out = subprocess.run([sys.executable, "-m", "flashtree", "generate", "word " * 3000, "--method", "ar",
                          "--max-model-len", "64"], capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 2 and out.stdout == ""
    line = one_line_error(out.stderr)
    assert "context holds 64" in line and "--max-model-len" in line


def test_threads_default_and_flag(capsys):
    assert 1 <= default_threads() <= physical_cores() <= (os.cpu_count() or 1)
    before = torch.get_num_threads()
    try:
        code, out, err = run_cli(capsys, "generate", "Hello", "--method", "ar", "--max-tokens", "3", "--threads", "1")
    finally:
        torch.set_num_threads(before)
    assert code == 0 and out.strip() and " threads=1 " in err


def test_stop_escapes():
    assert unescape(r"\n") == "\n" and unescape(r"a\tb") == "a\tb" and unescape(r"\\n") == "\\n"
    assert unescape(r"\x") == r"\x" and unescape("plain") == "plain"


def test_prompt_from_stdin_and_a_newline_stop(capsys, monkeypatch):
    argv = ["--method", "ar", "--max-tokens", "24"]
    code, direct, _ = run_cli(capsys, "generate", "def fib(n):", *argv)
    assert code == 0 and "\n" in direct.rstrip("\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("def fib(n):"))
    code, piped, _ = run_cli(capsys, "generate", "-", *argv)
    assert code == 0 and piped == direct
    code, stopped, err = run_cli(capsys, "generate", "def fib(n):", *argv, "--stop", r"\n")
    assert code == 0 and "\n" not in stopped.removesuffix("\n") and "finish=stop" in err
    assert direct.startswith(stopped.removesuffix("\n"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_startup_line_and_a_second_sigterm_exits_at_once():
    """`serve` prints one line naming what it loaded and where it listens. The first SIGTERM
    lets a running stream go on (grace 600 s); the second ends the process before it finishes."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flashtree", "serve", "--method", "ar", "--port", str(port),
                             "--threads", "1", "--shutdown-timeout", "600"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = proc.stderr.readline().strip()
        for field in ("model=flashtree-demo", "drafter=", "method=ar", "budget=", "device=cpu", "dtype=float32",
                      "threads=1", "max_batch=8", f"url=http://127.0.0.1:{port}"):
            assert field in line, line
        url = f"http://127.0.0.1:{port}"
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        started = threading.Event()

        def read():
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                    for x in r.iter_lines():
                        lines.append(x)
                        started.set()
            except httpx.HTTPError:
                pass
            started.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(60) and lines
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1.0)  # the stream holds the graceful shutdown open
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        reader.join(60)
        finished = [x for x in lines if x.startswith("data: {") and json.loads(x[6:])["choices"][0]["finish_reason"]]
        assert not finished, "the stream ran to its end: the second SIGTERM did not cut the wait short"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        proc.stdout.close()
