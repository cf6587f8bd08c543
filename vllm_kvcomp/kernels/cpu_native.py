"""kvcomp's CPU decode kernel: attention of virtual sequences over vLLM's CPU pages, merged with
a compensation token and sinks (``cpu_merged_attention.c``), for :class:`~vllm_kvcomp.engine.cache.CpuPagedCache`.

vLLM's CPU kernel returns no log-sum-exp, so a sequence that merges a RazorAttention
compensation token (or a layer's sinks) was attended in torch: ~60 small ops per layer, 3-4x the
kernel's own time for razor's heads. This one C function does it in one call per layer, and
attends every compressed decode row (over 30 layers' pages read from memory it takes 0.59–0.71x
of vLLM's kernel's time in block order and 0.71–0.79x over scattered pages, docs/kernels.md).

It is compiled on first use, as torch's inductor and Triton compile their CPU and launcher code:
with the machine's C compiler (``cc``, ``-O3 -march=native -fopenmp``) into
``$XDG_CACHE_HOME/vllm-kvcomp`` (default ``~/.cache/vllm-kvcomp``), one file per source, compiler
and CPU (a shared home directory across different CPUs gets one build per CPU), under a file lock
(tensor-parallel workers build it once). Where it cannot be built (no compiler) :func:`library`
is None, a warning says why once, and the cache attends by vLLM's kernel, merging in torch (exact,
slower).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_merged_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
#: the C function's limits (``MAX_G``, ``MAX_D``, ``MAX_BS``): larger calls attend in torch
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 32, 256, 256

#: pointers go as plain addresses (``Tensor.data_ptr()``; dtypes are checked here): with casts to
#: typed pointers and conversions, a call's host time was 58 µs, now 24 (one call per layer and step)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-kvcomp"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build(compiler: str | None = None) -> Path:
    """Compile the library (or find it built) and return its path; raises ``RuntimeError``
    saying why it cannot be built."""
    compiler = compiler or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, platform.machine(), _cpu_flags()])
                         .encode()).hexdigest()[:16]
    home = cache_dir()
    home.mkdir(parents=True, exist_ok=True)
    target = home / f"cpu_merged_attention-{key}.so"
    with open(home / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=home) as tmp:
                built = Path(tmp) / target.name
                run = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                     capture_output=True, text=True)
                if run.returncode:
                    raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[-2000:]}")
                built.replace(target)  # atomic: a reader never sees half a file
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library (built on the first call), or None (a warning says why) where it cannot be."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as err:
        logger.warning("vllm-kvcomp: the CPU merged-attention kernel is unavailable (%s); compressed rows "
                       "attend by vLLM's kernel, sequences with a compensation token or sinks in torch "
                       "(exact, slower)", err)
        return None
    fn = lib.kvcomp_merged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR,
                   _PTR, _PTR, _PTR, _PTR, _PTR, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_float, ctypes.c_float, ctypes.c_int]
    return lib


def covers(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> bool:
    """Whether :func:`merged_attention` takes calls of this kind (and the library is built)."""
    return (dtype == torch.float32 and group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
            and block_size <= MAX_BLOCK_SIZE and library() is not None)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, contiguous (itself when it already is: the cache's callers pass int32
    and float32, so that no layer converts)."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


def merged_attention(pages: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                     groups: Sequence[tuple[torch.Tensor, int]], query_start: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor, counts: torch.Tensor,
                     sinks: torch.Tensor | None, block_size: int, scale: float, softcap: float,
                     observe: torch.Tensor | None = None) -> None:
    """Write into ``out`` [R, G, D] the rows of each group's sequences (``groups``: indices [C]
    and T, their query rows each, from ``query_start`` [S+1]): their causal attention over their
    ``tables`` [S, W] pages holding ``lengths`` [S] cells, merged with their compensation token
    (``k_hat``/``v_hat`` [S, D], ``counts`` [S], 0 = none) and ``sinks`` [S, G] (or None).
    ``pages`` [P, 2·bs·D] is the cache (per page K^T [D, bs] then V [bs, D]); pages, q and out
    contiguous float32. ``observe`` [S] int64 (or None): addresses of float32 rows of at least
    ``lengths[s]`` cells (0 = none) to which a sequence of one query row adds the softmax weight of
    each of its cells among its cells alone (soft-capped logits where ``softcap``; no token, no
    sink), the mean over its G query heads: what H2O accumulates
    (:class:`~vllm_kvcomp.engine.state.ObservedAttention`). Groups of T > 1 rows observe nothing."""
    if pages.dtype != torch.float32 or not (pages.is_contiguous() and q.is_contiguous() and out.is_contiguous()):
        raise ValueError("merged_attention takes contiguous float32 pages, q and out")
    g, d = q.shape[1], q.shape[2]
    i32, f32 = torch.int32, torch.float32
    starts, table, ends = _as(query_start, i32), _as(tables, i32), _as(lengths, i32)
    k_hat, v_hat, counts = _as(k_hat, f32), _as(v_hat, f32), _as(counts, f32)
    sinks = None if sinks is None else _as(sinks, f32)
    observe = None if observe is None else _as(observe, torch.int64)
    fn = library().kvcomp_merged_attention
    for seqs, queries in groups:
        seqs = _as(seqs, i32)
        status = fn(pages.data_ptr(), pages.shape[1], q.data_ptr(), out.data_ptr(), seqs.data_ptr(), seqs.numel(),
                    queries, starts.data_ptr(), table.data_ptr(), table.shape[1], ends.data_ptr(), k_hat.data_ptr(),
                    v_hat.data_ptr(), counts.data_ptr(), None if sinks is None else sinks.data_ptr(),
                    None if observe is None else observe.data_ptr(), g, d,
                    block_size, scale, softcap, torch.get_num_threads())
        if status:
            raise ValueError(f"merged_attention: G={g}, D={d} or block size {block_size} is past its limits")
