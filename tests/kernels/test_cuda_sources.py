"""The CUDA extension's sources: they compile here (nvcc, sm_90), the torch binding links and
registers its ops; on a GPU with the extension built, the kernels match the references."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers.kernel_refs import (
    assert_close_to_ref,
    make_paged,
    random_selection,
    random_starts,
    ref_compact,
    ref_decode,
)
from tests.kernels.cases import COVER, Case
from vllm_kvcomp import ops

CSRC = Path(__file__).resolve().parents[2] / "csrc"
ARCH = os.environ.get("KVCOMP_TEST_CUDA_ARCH", "sm_90")
EXPORTS = ("kvcomp_compact_heads", "kvcomp_decode_attention", "kvcomp_error_string")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if found is None and Path(home, "bin", "nvcc").exists():
        found = str(Path(home, "bin", "nvcc"))
    return found


NVCC = _nvcc()
CXX = shutil.which("c++") or shutil.which("g++")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")


def _run_all(commands: list[list[str]]) -> None:
    """Run compiler commands in parallel; fail with the first one's diagnostics."""
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in commands
    ]
    for cmd, proc in zip(commands, procs):
        out, _ = proc.communicate()
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{out}"


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two .cu files compiled to relocatable objects for ARCH (ptxas included), with the
    flags a torch extension build adds (no implicit half/bfloat16 conversions)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    out = tmp_path_factory.mktemp("kvcomp_cuda")
    objs = {name: out / f"{name}.o" for name in ("compaction", "decode_attention")}
    _run_all(
        [
            [
                NVCC,
                "-std=c++20",
                "-O3",
                f"-arch={ARCH}",
                *COMMON_NVCC_FLAGS,
                "-Xcompiler",
                "-fPIC",
                "-Werror",
                "all-warnings",
                "-c",
                str(CSRC / f"{name}.cu"),
                "-o",
                str(obj),
            ]
            for name, obj in objs.items()
        ]
    )
    return objs


@needs_nvcc
def test_cu_sources_compile_standalone(objects: dict[str, Path]) -> None:
    """nvcc builds both kernels files without torch; the launchers have C linkage."""
    symbols = ""
    for obj in objects.values():
        assert obj.stat().st_size > 0
        if shutil.which("nm"):
            symbols += subprocess.run(
                ["nm", "-g", "--defined-only", str(obj)], capture_output=True, text=True
            ).stdout
    if symbols:
        for name in EXPORTS:
            assert f" T {name}\n" in symbols, f"{name} is not exported with C linkage"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_header_is_plain_c() -> None:
    proc = subprocess.run(
        ["cc", "-x", "c", "-std=c99", "-fsyntax-only", str(CSRC / "kvcomp_kernels.h")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


@needs_nvcc
@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_binding_links_and_registers_ops(objects: dict[str, Path], tmp_path: Path) -> None:
    """bindings.cpp compiles against this torch (no CUDA headers needed), links with the kernels
    into a loadable module whose ops have the schemas ops.py calls and check their arguments."""
    from torch.utils.cpp_extension import include_paths, library_paths

    binding = tmp_path / "bindings.o"
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    _run_all(
        [
            [
                CXX,
                "-std=c++20",
                "-O1",
                "-fPIC",
                "-w",
                *includes,
                "-c",
                str(CSRC / "bindings.cpp"),
                "-o",
                str(binding),
            ]
        ]
    )
    lib = tmp_path / "_C.so"
    torch_lib = library_paths()[0]
    # nvcc links (it knows where its static cudart lives)
    _run_all(
        [
            [
                NVCC,
                "-shared",
                "-o",
                str(lib),
                str(binding),
                *map(str, objects.values()),
                f"-L{torch_lib}",
                "-lc10",
                "-ltorch_cpu",
                "-ltorch",
                "-Xlinker",
                f"-rpath,{torch_lib}",
            ]
        ]
    )
    script = textwrap.dedent(f"""
        import torch
        torch.ops.load_library({str(lib)!r})
        for name in ("compact_heads", "decode_attention"):
            print(getattr(torch.ops.kvcomp, name).default._schema)
        x = torch.zeros(1, 1, 1, 128)
        try:
            torch.ops.kvcomp.compact_heads(x, *(torch.zeros(1, 1, dtype=torch.int32),) * 2, x, x, x, 0)
        except RuntimeError as e:
            print("REJECTED", str(e).splitlines()[0])
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "kvcomp::compact_heads(Tensor(a!) kv_cache, Tensor block_table" in proc.stdout
    assert (
        "Tensor? k_hat, Tensor? v_hat, Tensor? comp_counts, float scale, int num_splits"
        in proc.stdout
    )
    assert "REJECTED kv_cache must be a CUDA" in proc.stdout


# ---------------------------------------------------------------------------- on a GPU

needs_extension = pytest.mark.skipif(
    not ops.cuda_extension_available(), reason="vllm_kvcomp._C not built"
)


@pytest.mark.gpu
@needs_extension
@pytest.mark.parametrize("case", COVER, ids=str)
def test_cuda_decode_matches_reference(case: Case) -> None:
    lens, hk = [300, 1, 77], 2
    paged = make_paged(lens, hk, case.head_dim, case.block_size, case.dtype, "cuda", case.layout)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(lens), hk * case.group, case.head_dim, generator=gen).to(case.dtype)
    starts = random_starts(lens, hk, min_len=0) if case.ragged else None
    comp = None
    if case.comp:
        comp = (
            torch.randn(len(lens), hk, case.head_dim),
            torch.randn(len(lens), hk, case.head_dim),
            torch.tensor([[3.0, 0.0], [1.0, 9.0], [0.0, 2.0]]),
        )
    out, lse = ops.decode_attention(
        q.cuda(),
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        None if starts is None else starts.cuda(),
        None if comp is None else tuple(t.cuda() for t in comp),
        num_splits=5,
        backend="cuda",
    )
    scale = case.head_dim**-0.5
    o64, l64 = ref_decode(q, paged.cpu(), starts, scale, comp, torch.float64)
    o_lp, l_lp = ref_decode(q, paged.cpu(), starts, scale, comp, case.dtype)
    assert_close_to_ref(out, o64, o_lp, what=f"out {case}")
    assert_close_to_ref(lse, l64, l_lp, what=f"lse {case}")


@pytest.mark.gpu
@needs_extension
@pytest.mark.parametrize("case", COVER, ids=str)
def test_cuda_compaction_matches_reference(case: Case) -> None:
    lens, hk = [300, 1, 77, 40], 3
    paged = make_paged(lens, hk, case.head_dim, case.block_size, case.dtype, "cuda", case.layout)
    starts = random_starts(lens, hk, min_len=0)
    kept, counts = random_selection(lens, starts, keep=0.3)
    want = ref_compact(paged.cpu(), kept, counts)
    ops.compact_heads(
        paged.cache, paged.block_table, paged.seq_lens, kept.cuda(), counts.cuda(), backend="cuda"
    )
    torch.testing.assert_close(paged.cache.cpu(), want, atol=0, rtol=0, equal_nan=True)
