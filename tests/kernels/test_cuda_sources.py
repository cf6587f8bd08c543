"""The CUDA extension's sources: they compile here (nvcc, sm_90), the torch binding links and
registers its op; on a GPU with the extension built, the kernel matches the reference.

Without nvcc the compile tests are reported as SKIPPED with the reason (``-ra`` lists them);
they never pass vacuously.
"""

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

from tests.helpers.kernel_refs import assert_decode_close
from tests.kernels.cases import COVER, Case
from vllm_kvcomp import kernels
from vllm_kvcomp.kernels.fixtures import make_paged, random_starts

CSRC = Path(__file__).resolve().parents[2] / "csrc"
ARCH = os.environ.get("KVCOMP_TEST_CUDA_ARCH", "sm_90")
SOURCES = ("decode_attention",)  # csrc/<name>.cu
EXPORTS = ("kvcomp_decode_attention", "kvcomp_error_string")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if found is None and Path(home, "bin", "nvcc").exists():
        found = str(Path(home, "bin", "nvcc"))
    return found


NVCC = _nvcc()
CXX = shutil.which("c++") or shutil.which("g++")
NM = shutil.which("nm")
needs_nvcc = pytest.mark.skipif(
    NVCC is None,
    reason="nvcc not found on PATH or in $CUDA_HOME/bin: the CUDA sources were not compiled",
)


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
    """The .cu files compiled to relocatable objects for ARCH (ptxas included), with the flags a
    torch extension build adds (no implicit half/bfloat16 conversions)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    out = tmp_path_factory.mktemp("kvcomp_cuda")
    objs = {name: out / f"{name}.o" for name in SOURCES}
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


def test_only_the_decode_kernel_is_left() -> None:
    """Every .cu file is compiled below and built by setup.py; nothing else hides in csrc/."""
    assert sorted(p.stem for p in CSRC.glob("*.cu")) == sorted(SOURCES)
    setup_py = (CSRC.parent / "setup.py").read_text()
    for name in SOURCES:
        assert f"csrc/{name}.cu" in setup_py


@needs_nvcc
def test_cu_sources_compile_standalone(objects: dict[str, Path]) -> None:
    """nvcc builds the kernel files without torch."""
    for obj in objects.values():
        assert obj.stat().st_size > 0


@needs_nvcc
@pytest.mark.skipif(NM is None, reason="nm (binutils) not installed: symbols not inspected")
def test_launchers_have_c_linkage(objects: dict[str, Path]) -> None:
    symbols = "".join(
        subprocess.run(
            [NM, "-g", "--defined-only", str(obj)], capture_output=True, text=True, check=True
        ).stdout
        for obj in objects.values()
    )
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
    into a loadable module whose op has the schema vllm_kvcomp.kernels calls and checks its
    arguments."""
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
        print(torch.ops.kvcomp.decode_attention.default._schema)
        print("HAS compact_heads", hasattr(torch.ops.kvcomp, "compact_heads"))
        x, i = torch.zeros(1, 1, 1, 128), torch.zeros(1, 1, dtype=torch.int32)
        try:
            torch.ops.kvcomp.decode_attention(
                x[0], x, i, i[0], i, None, None, None, 1.0, 1, x, x, x[0], x, 0)
        except RuntimeError as e:
            print("REJECTED", str(e).splitlines()[0])
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "kvcomp::decode_attention(Tensor q, Tensor kv_cache, Tensor block_table" in proc.stdout
    assert "HAS compact_heads False" in proc.stdout
    assert (
        "Tensor? k_hat, Tensor? v_hat, Tensor? comp_counts, float scale, int num_splits"
        in proc.stdout
    )
    assert "REJECTED kv_cache must be a CUDA" in proc.stdout


# ---------------------------------------------------------------------------- on a GPU

needs_extension = pytest.mark.skipif(
    not kernels.cuda_extension_available(), reason="vllm_kvcomp._C not built"
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
    out, lse = kernels.decode_attention(
        q.cuda(),
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        None if starts is None else starts.cuda(),
        None if comp is None else tuple(t.cuda() for t in comp),
        num_splits=5,
        backend="cuda",
    )
    assert_decode_close(q, paged, starts, comp, case.head_dim**-0.5, out, lse, what=str(case))
