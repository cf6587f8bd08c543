"""kvcomp's CPU decode kernel: attention of virtual sequences over vLLM's CPU pages, merged with
a compensation token and sinks (``cpu_merged_attention.c``), for :class:`~vllm_kvcomp.engine.cache.CpuPagedCache`.

vLLM's CPU kernel returns no log-sum-exp, so a sequence that merges a RazorAttention
compensation token (or a layer's sinks) was attended in torch: ~60 small ops per layer, 3-4x the
kernel's own time for razor's heads. This one C function does it in one call per layer, and
attends every compressed decode row (over 30 layers' pages it takes half the time of vLLM's
kernel, docs/kernels.md).

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

_I64, _F32P = ctypes.c_int64, ctypes.POINTER(ctypes.c_float)
_I32P = ctypes.POINTER(ctypes.c_int32)


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
    fn.argtypes = [_F32P, _I64, _F32P, _F32P, _I32P, _I64, _I64, _I32P, _I32P, _I64, _I32P,
                   _F32P, _F32P, _F32P, _F32P, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_float, ctypes.c_float, ctypes.c_int]
    return lib


def covers(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> bool:
    """Whether :func:`merged_attention` takes calls of this kind (and the library is built)."""
    return (dtype == torch.float32 and group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
            and block_size <= MAX_BLOCK_SIZE and library() is not None)


def _ptr(t: torch.Tensor, kind):
    return ctypes.cast(t.data_ptr(), kind)


def merged_attention(pages: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                     groups: Sequence[tuple[torch.Tensor, int]], query_start: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor, counts: torch.Tensor,
                     sinks: torch.Tensor | None, block_size: int, scale: float, softcap: float) -> None:
    """Write into ``out`` [R, G, D] the rows of each group's sequences (``groups``: indices [C]
    and T, their query rows each, from ``query_start`` [S+1]): their causal attention over their
    ``tables`` [S, W] pages holding ``lengths`` [S] cells, merged with their compensation token
    (``k_hat``/``v_hat`` [S, D], ``counts`` [S], 0 = none) and ``sinks`` [S, G] (or None).
    ``pages`` [P, 2·bs·D] is the cache (per page K^T [D, bs] then V [bs, D]); pages, q and out
    contiguous float32."""
    if pages.dtype != torch.float32 or not (pages.is_contiguous() and q.is_contiguous() and out.is_contiguous()):
        raise ValueError("merged_attention takes contiguous float32 pages, q and out")
    g, d = q.shape[1], q.shape[2]
    starts, table, ends = (x.to(torch.int32).contiguous() for x in (query_start, tables, lengths))
    k_hat, v_hat, counts = (x.float().contiguous() for x in (k_hat, v_hat, counts))
    sinks = None if sinks is None else sinks.float().contiguous()
    fn = library().kvcomp_merged_attention
    for seqs, queries in groups:
        seqs = seqs.to(torch.int32).contiguous()
        status = fn(_ptr(pages, _F32P), pages.shape[1], _ptr(q, _F32P), _ptr(out, _F32P), _ptr(seqs, _I32P),
                    seqs.numel(), queries, _ptr(starts, _I32P), _ptr(table, _I32P), table.shape[1],
                    _ptr(ends, _I32P), _ptr(k_hat, _F32P), _ptr(v_hat, _F32P), _ptr(counts, _F32P),
                    None if sinks is None else _ptr(sinks, _F32P), g, d, block_size, scale, softcap,
                    torch.get_num_threads())
        if status:
            raise ValueError(f"merged_attention: G={g}, D={d} or block size {block_size} is past its limits")
