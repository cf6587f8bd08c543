"""What every benchmark shares: SIGTERM stops a benchmark the way Ctrl-C does."""

from __future__ import annotations

import os
import signal
import time
import types

import pytest

from vllm_kvcomp.bench.common import run_benchmark


def test_sigterm_unwinds_a_benchmark_so_the_servers_it_started_are_stopped(tmp_path):
    stopped = []

    def run(args):
        try:  # as `served` does: the server is stopped in a finally
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here, inside the try
        finally:
            stopped.append(True)

    bench = types.ModuleType("fake_bench", "A benchmark that is killed.")
    bench.add_arguments = lambda parser: None
    bench.run = run
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(bench, "fake", ["--out", str(tmp_path / "out.md")], ["vllm-kvcomp", "bench", "fake"])
    assert stopped == [True]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_server_that_exits_at_startup_is_reported_with_its_last_error(tmp_path):
    """``served`` raises with the reason from the server log (e.g. pydantic's for a max model length
    over the model's positions), not only the log's path; a log that names none adds nothing."""
    import subprocess
    import sys

    from vllm_kvcomp.bench.serving import _wait_healthy

    log = tmp_path / "server.log"
    log.write_text("WARNING ulimit failed with error current limit exceeds maximum limit\n"
                   "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
                   "  Value error, User-specified max_model_len (8256) is greater than the derived max_model_len\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    with pytest.raises(RuntimeError, match=r"exited with 1: Value error, User-specified max_model_len \(8256\)"):
        _wait_healthy("http://127.0.0.1:9", proc, log)
    log.write_text("INFO starting\n")
    with pytest.raises(RuntimeError, match=r"exited with 1; see "):
        _wait_healthy("http://127.0.0.1:9", proc, log)
