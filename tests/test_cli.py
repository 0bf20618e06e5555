"""The command line as a new user meets it: one-line errors, --version, python -m flashtree,
--threads, --stop escapes, a prompt from stdin, and `serve`'s startup line and signals; what
it imports before answering, what it says first, and what it warns about."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

import flashtree.cli as cli
from flashtree import __version__
from flashtree.cli import busy_cores_warning, default_threads, main, physical_cores, stats_line, unescape

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


ANNOUNCE = re.compile(r"flashtree [a-z]+: (loading .+|starting) \.\.\.$")  # a command's first line


def one_line_error(err: str) -> str:
    """The error line, which must be all of stderr but the command's first line (what it loads)."""
    lines = err.strip().splitlines()
    if lines and ANNOUNCE.fullmatch(lines[0]):
        lines = lines[1:]
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
        assert proc.stderr.readline().strip() == "flashtree serve: loading the embedded demo pair ..."
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


# ---- an honest start -----------------------------------------------------------------------------

HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "numpy")


def imported(argv: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `python -X importtime -m flashtree argv`: the run, and every module it imported."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "flashtree", *argv], capture_output=True,
                         text=True, env=ENV, timeout=300)
    return run, [line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["generate", "--help"], ["serve", "--help"],
                                  ["bench", "--help"], ["train", "--help"], ["train", "demo", "--help"]])
def test_version_and_help_import_nothing_heavy(argv):
    """--version and every --help answer without importing torch, transformers, FastAPI or uvicorn
    (which took 3.5-6 s on the shared box; `time flashtree --version` is now about 0.2 s there)."""
    run, modules = imported(argv)
    assert run.returncode == 0 and run.stdout.strip()
    assert not [m for m in modules if m.split(".")[0] in HEAVY], argv


def test_a_command_says_what_it_loads_before_torch_loads():
    """`generate` prints its first line before importing torch, so no command sits silent for the
    seconds torch and the models take."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "flashtree", "generate", "hi", "--method", "ar",
                          "--max-tokens", "2"], capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if not line.startswith("import time:"))
    torch_at = next(i for i, line in enumerate(lines) if re.search(r"\|\s*torch$", line))
    assert lines[first] == "flashtree generate: loading the embedded demo pair ..." and first < torch_at


def test_max_model_len_above_the_target_limit(capsys):
    """--max-model-len above the target's max_position_embeddings (2048 for the demo target) is a
    one-line error naming both numbers; --allow-long-max-model-len lets it through."""
    code, _, err = run_cli(capsys, "generate", "hi", "--method", "ar", "--max-model-len", "300000")
    line = one_line_error(err)
    assert code == 2 and "300000" in line and "2048" in line and "--allow-long-max-model-len" in line
    code, out, err = run_cli(capsys, "generate", "hi", "--method", "ar", "--max-tokens", "2", "--max-model-len",
                             "2100", "--allow-long-max-model-len")
    assert code == 0 and out.strip() and "tokens=2" in err


@pytest.mark.parametrize("setting,words", [
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot reach the Hugging Face hub"),  # nothing listens on port 9
])
def test_an_offline_hub_id_is_reported_as_offline_first(tmp_path, setting, words):
    """A hub id that is not cached, with the hub switched off or out of reach, is named as such,
    before the missing drafter (which the same command also lacks) is."""
    env = {**ENV, "HF_HOME": str(tmp_path / "hf"), **setting}
    env.pop("HF_HUB_OFFLINE" if "HF_ENDPOINT" in setting else "HF_ENDPOINT", None)
    run = subprocess.run([sys.executable, "-m", "flashtree", "generate", "hi", "--target", "Qwen/Qwen3-8B"],
                         capture_output=True, text=True, env=env, timeout=300)
    line = one_line_error(run.stderr)
    assert run.returncode == 2 and words in line and "Qwen/Qwen3-8B" in line and "drafter" not in line


def test_busy_cores_warning(monkeypatch):
    """More torch threads than free cores (by the load average) is one warning line suggesting
    --threads 1; one thread, or enough free cores, is none."""
    monkeypatch.setattr(cli, "physical_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    line = busy_cores_warning(2)
    assert "2 threads" in line and "only 1 of this machine's 2 cores" in line and line.endswith("--threads 1")
    assert busy_cores_warning(1) is None
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert busy_cores_warning(2) is None


@pytest.mark.slow  # --compile on the CPU compiles the demo pair's layers at start-up
def test_stats_leave_start_up_capture_out_and_say_so(capsys):
    """generate's tok/s is over the generate call alone, and with --compile the line names the
    start-up compile and capture seconds as not counted (they once went into tok/s: tok/s=0.8)."""
    out = type("Out", (), {"token_ids": list(range(40)), "finish_reason": "length",
                           "stats": type("S", (), {"mean_accept_length": 2.0, "rounds": 20})()})()
    line = stats_line("ddtree", out, seconds=4.0, captured=46.0)
    assert " tok/s=10.0 " in line and line.endswith("capture_s=46.0 (at start-up, not in tok/s)")
    assert "capture" not in stats_line("ddtree", out, seconds=4.0, captured=0.0)
    code, _, err = run_cli(capsys, "generate", "hi", "--method", "dflash", "--max-tokens", "4", "--compile")
    assert code == 0 and re.search(r"capture_s=\d+\.\d \(at start-up, not in tok/s\)$", err.strip()), err


def test_rounds_far_slower_than_predicted_warn_once(caplog, monkeypatch):
    """Rounds that take several times what the start-up cost measurement predicted, with more than
    one torch thread on the CPU, log one warning suggesting --threads 1; with one thread, or at
    the predicted pace, nothing. The engine feeds every budget="auto" round to the watch."""
    from flashtree import LLM, SamplingParams
    from flashtree.engine.pace import ROUNDS, SKIP, PaceWatch

    def run(threads: int, seconds: float) -> PaceWatch:
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        watch = PaceWatch(torch.device("cpu"))
        for _ in range(SKIP + 3 * ROUNDS):
            watch.observe(seconds, 0.02)
        return watch

    with caplog.at_level("WARNING", logger="flashtree"):
        slow = run(2, 0.18)
        assert run(1, 0.18).warned is None and run(2, 0.03).warned is None
    assert "9.0x" in slow.warned and slow.warned.endswith("use --threads 1 (torch.set_num_threads(1))")
    assert [r.getMessage() for r in caplog.records] == [slow.warned]
    monkeypatch.undo()
    llm = LLM(device="cpu", dtype="float32", max_batch=1)  # the demo pair, budget="auto"
    llm.generate(["def fib(n):"], SamplingParams(max_tokens=16, ignore_eos=True))
    assert llm.engine.pace.seen >= 1


def test_no_pack_weights_reaches_the_engine(capsys, monkeypatch):
    """--no-pack-weights builds the engine with pack_weights=False (F.linear); unset leaves the default."""
    seen = []
    real = cli.engine_kwargs
    monkeypatch.setattr(cli, "engine_kwargs", lambda args: seen.append(real(args)) or seen[-1])
    for flags in ((), ("--no-pack-weights",)):
        code, out, _ = run_cli(capsys, "generate", "Hello", "--method", "ar", "--max-tokens", "2", *flags)
        assert code == 0 and out.strip()
    assert [k["pack_weights"] for k in seen] == [None, False]
