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
