"""A reader that goes away (`attnlab demo | head -1`) ends every command quietly: no
traceback, exit code 1, whatever the command was printing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _run_into_closed_pipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``python -m attnlab ARGS`` with a stdout whose reader has already gone."""
    read, write = os.pipe()
    os.close(read)  # every write to `write` now fails with EPIPE
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        return subprocess.run([sys.executable, "-m", "attnlab", *args], stdout=write,
                              stderr=subprocess.PIPE, text=True, cwd=cwd, env=env, timeout=300)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [
    ["demo", "--model", "random"],
    ["explain", "The bank of the river", "--model", "random", "--steps"],
    ["explain", "The bank of the river", "--model", "random", "--format", "json"],
    ["bench", "--sections", "sdpa", "--shapes", "sweep", "--sizes", "64", "--repeats", "1", "--passes", "fwd"],
    ["train", "--steps", "2", "--eval-every", "1"],
], ids=["demo", "explain-steps", "explain-json", "bench", "train"])
def test_a_closed_stdout_never_prints_a_traceback(tmp_path, args):
    done = _run_into_closed_pipe(args, tmp_path)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr


@pytest.mark.parametrize("args", [["--help"], ["explain", "--help"], ["--version"]])
def test_help_into_a_closed_pipe_prints_nothing_on_stderr(tmp_path, args):
    assert _run_into_closed_pipe(args, tmp_path).stderr == ""


def test_the_same_commands_print_when_someone_reads(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-m", "attnlab", "demo", "--model", "random"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("model")
