"""On a GPU: the attention backend vLLM 0.32 picks, and the engine settings vllm-kvcomp cannot
compress under. Each case is compressed, or refused at start-up with a message naming the flag
that fixes it (never served silently wrong).

A case is a GPU (its compute capability), a model (a plain decoder layer: head size 128,
bfloat16, ``--kv-cache-dtype auto``; ``sinks``: with learned attention sinks, as gpt-oss) and
the flags an operator passes. It runs what a real start runs, on this CPU build:

- ``vllm-kvcomp serve``'s flag check (``cli.prepare``);
- vLLM's own ``VllmConfig`` resolution with the KVCompConnector, as on CUDA (static CUDA graphs,
  Model Runner V2), then ``support.startup_error`` on it (what the connector refuses as the
  engine starts);
- vLLM's own CUDA backend selector (``CudaPlatformBase.get_attn_backend_cls``) for the device's
  compute capability, with our CUDA backends registered as the plugin does and FlashInfer
  importable (vLLM's CUDA image ships it; its compiled parts are stubbed: only its backend's
  class methods run), then the connector's check of the layer it picked (``paged_cache``).

:data:`CASES` is the one list: docs/compatibility.md's GPU table is rendered from it
(``python -m tests.engine.test_backend_choice`` rewrites it between its markers; the whole doc is
also rendered by ``python -m tests.engine.test_compatibility``), and
``test_the_table_is_current`` fails when it is stale. Nothing here ran on a GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.machinery
import json
import shlex
import sys
import tempfile
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from vllm_kvcomp import vllm_compat
from vllm_kvcomp.engine import support
from vllm_kvcomp.engine.cache import CudaPagedCache
from vllm_kvcomp.engine.connector import paged_cache
from vllm_kvcomp.engine.plugin import kv_transfer_config, register_with_vllm
from vllm_kvcomp.engine.support import backend_overrides
from vllm_kvcomp.server import cli

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compatibility.md"
COMMAND = "python -m tests.engine.test_backend_choice"
START = f"<!-- gpu-backend-table:start (generated: {COMMAND}) -->"
END = "<!-- gpu-backend-table:end -->"
LAYER = "model.layers.0.self_attn.attn"
BLOCK = 16
COMPRESSES, REFUSED, VLLM_REFUSES = "compresses", "refused at start-up", "vLLM refuses to start"
EARLY = "refused before vLLM starts"  # by vllm-kvcomp serve, from the flags
GPUS = {(7, 5): "T4", (8, 0): "A100", (8, 9): "L4, L40S", (9, 0): "H100, H200", (10, 0): "B200, GB200",
        (12, 0): "RTX PRO 6000, RTX 5090"}
#: serve flags vLLM copies into its ``ParallelConfig`` unchanged
PARALLEL_FLAGS = ("tensor_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size",
                  "enable_dbo", "ubatch_size", "all2all_backend")
DBO = ("--all2all-backend", "deepep_low_latency")  # vLLM micro-batches only with these all-to-all kernels


@dataclasses.dataclass(frozen=True)
class Case:
    """One start: GPU, model, the operator's flags; what the engine must give (:data:`COMPRESSES`,
    :data:`REFUSED`, :data:`VLLM_REFUSES`), whether ``vllm-kvcomp serve`` refuses it from the
    flags (``early``) and, for a refusal, the fix its message names (``names``) and the flags of
    the command line with that fix (``fixed``)."""

    name: str
    capability: tuple[int, int]
    flags: tuple[str, ...] = ()
    sinks: bool = False
    expected: str = COMPRESSES
    early: bool = False
    names: str = ""
    fixed: tuple[str, ...] | None = None


FA = ("--attention-backend", "FLASH_ATTN")
PASS_FA = "pass --attention-backend FLASH_ATTN"
OFF = "leave it off"
CASES = [
    Case("t4", (7, 5)),
    Case("a100", (8, 0)),
    Case("l40s", (8, 9)),
    Case("h100", (9, 0)),
    Case("b200", (10, 0), expected=REFUSED, names=PASS_FA, fixed=FA),
    Case("b200-flash-attn", (10, 0), FA),
    Case("b200-triton", (10, 0), ("--attention-backend", "TRITON_ATTN")),
    Case("rtx-pro", (12, 0)),
    Case("a100-sinks", (8, 0), sinks=True),
    Case("t4-flash-attn", (7, 5), FA, expected=VLLM_REFUSES),
    Case("h100-flashinfer", (9, 0), ("--attention-backend", "FLASHINFER"), expected=REFUSED, early=True,
         names=PASS_FA, fixed=FA),
    Case("h100-flex", (9, 0), ("--attention-backend", "FLEX_ATTENTION"), expected=REFUSED, early=True, names=PASS_FA,
         fixed=FA),
    Case("h100-per-kind", (9, 0), ("--attention-config.backend_per_kind", '{"full_attention": "FLASHINFER"}'),
         expected=REFUSED, early=True, names="map full_attention to FLASH_ATTN", fixed=(
             "--attention-config.backend_per_kind", '{"full_attention": "FLASH_ATTN"}')),
    Case("h100-full-graphs", (9, 0), ("-cc.cudagraph_mode=FULL",)),
    Case("h100-full-decode-graphs", (9, 0), ("-cc.cudagraph_mode=FULL_DECODE_ONLY",)),
    Case("h100-attention-quant-fusion", (9, 0), ("-cc.pass_config.fuse_attn_quant=true",), expected=REFUSED,
         early=True, names="pass -cc.pass_config.fuse_attn_quant=false", fixed=("-cc.pass_config.fuse_attn_quant=false",)),
    Case("h100-attention-in-graph-pieces", (9, 0),
         ("-cc.cudagraph_mode=PIECEWISE", '-cc.splitting_ops=["vllm::unified_kv_cache_update"]'), expected=REFUSED,
         names="leave -cc.splitting_ops unset", fixed=("-cc.cudagraph_mode=PIECEWISE",)),
    Case("h100-dbo", (9, 0), ("--enable-dbo", *DBO), expected=REFUSED, early=True, names=OFF, fixed=DBO),
    Case("h100-ubatch", (9, 0), ("--ubatch-size", "2", *DBO), expected=REFUSED, early=True, names=OFF, fixed=DBO),
    Case("h100-dcp", (9, 0), ("--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"), expected=REFUSED,
         early=True, names="pass --decode-context-parallel-size 1",
         fixed=("--tensor-parallel-size", "2", "--decode-context-parallel-size", "1")),
    Case("h100-pcp", (9, 0), ("--prefill-context-parallel-size", "2"), expected=VLLM_REFUSES, early=True,
         names="pass --prefill-context-parallel-size 1", fixed=("--prefill-context-parallel-size", "1")),
]
CASE = {case.name: case for case in CASES}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a start gives: the backend vLLM picks for the layer ("none" when vLLM refuses), the
    CUDA graph mode it resolves, the engine's verdict and message (``vllm serve`` with the
    connector), and ``vllm-kvcomp serve``'s own refusal of the flags ("" when it starts vLLM)."""

    backend: str
    graphs: str
    verdict: str
    message: str = ""
    serve_message: str = ""

    @property
    def serve_verdict(self) -> str:
        return EARLY if self.serve_message else self.verdict

    @property
    def first_message(self) -> str:
        """The refusal ``vllm-kvcomp serve`` shows."""
        return self.serve_message or self.message


# ----------------------------------------------------------------------------- vLLM's CUDA paths on CPU


class _CompiledStub(types.ModuleType):
    """A compiled module this CPU build lacks: importable, every attribute a mock (never called:
    only the backends' class methods run)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return mock.MagicMock(name=f"{self.__name__}.{name}")


STUBS = ("vllm._C_stable_libtorch", "flashinfer", "flashinfer.decode", "flashinfer.prefill", "flashinfer.utils")


@contextmanager
def cuda_selection() -> Iterator[None]:
    """vLLM's CUDA platform and FlashInfer backend importable, our CUDA backends registered under
    vLLM's names (as the plugin does on CUDA); the stubs and registrations undone on exit."""
    from vllm.v1.attention.backends import registry

    saved_modules = {name: sys.modules.get(name) for name in STUBS}
    saved_overrides = dict(registry._ATTN_OVERRIDES)
    for name in STUBS:
        stub = _CompiledStub(name)
        stub.__spec__, stub.__path__ = importlib.machinery.ModuleSpec(name, None), []
        sys.modules[name] = stub
    for name, path in backend_overrides("cuda").items():
        vllm_compat.register_attention_backend(name, path)
    try:
        yield
    finally:
        registry._ATTN_OVERRIDES.clear()
        registry._ATTN_OVERRIDES.update(saved_overrides)
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextmanager
def cuda_config_resolution() -> Iterator[None]:
    """``VllmConfig`` resolved as on CUDA: static CUDA graphs, Triton present (Model Runner V2),
    none of the CPU platform's rewrites (it turns graphs and micro-batching off)."""
    import vllm.config.vllm as config_module
    from vllm.platforms import current_platform

    platform = type(current_platform)
    with mock.patch.object(config_module, "HAS_TRITON", True), \
            mock.patch.object(platform, "support_static_graph_mode", classmethod(lambda cls: True)), \
            mock.patch.object(platform, "is_cuda_alike", classmethod(lambda cls: True)), \
            mock.patch.object(platform, "check_and_update_config", classmethod(lambda cls, config: None)):
        yield


def fake_cuda(capability: tuple[int, int]):
    """vLLM's CUDA platform class on a device of ``capability``."""
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class FakeCuda(CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*capability)

    return FakeCuda


# ----------------------------------------------------------------------------- one start


def parse(model_dir: Path, flags: tuple[str, ...]):
    """``vllm-kvcomp serve MODEL FLAGS`` parsed (a fresh parser: prepare edits list defaults)."""
    parser, vllm_defaults = cli.build_parser()
    return parser.parse_args([str(model_dir), *flags]), vllm_defaults


def resolved_config(args):
    """The ``VllmConfig`` vLLM builds from these flags with the KVCompConnector, on CUDA (the
    fields the start-up checks and the selector read; EngineArgs merges ``--attention-backend``
    into the attention config the same way)."""
    from vllm.config import AttentionConfig, KVTransferConfig, ParallelConfig, VllmConfig

    register_with_vllm()  # vLLM resolves the graph mode with the connector class's answer
    attention = copy.deepcopy(args.attention_config)
    if args.attention_backend is not None:
        attention.backend = AttentionConfig.validate_backend_before(args.attention_backend)
    parallel = ParallelConfig(**{name: getattr(args, name) for name in PARALLEL_FLAGS})
    with cuda_config_resolution():
        return VllmConfig(compilation_config=copy.deepcopy(args.compilation_config), attention_config=attention,
                          parallel_config=parallel, kv_transfer_config=KVTransferConfig(**kv_transfer_config()))


def selected_backend(case: Case, config) -> type:
    """The backend class vLLM 0.32's CUDA selector picks for the case's layer (ValueError: vLLM's
    own refusal, as ``--attention-backend`` forces one that is not valid there)."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    attention, parallel = config.attention_config, config.parallel_config
    selector = AttentionSelectorConfig(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, has_sink=case.sinks,
        use_kv_connector=True, use_dcp=parallel.decode_context_parallel_size > 1,
        use_pcp=parallel.prefill_context_parallel_size > 1)
    forced = attention.backend_per_kind.get(support.FULL_ATTENTION_KIND, attention.backend)
    with set_current_vllm_config(config):
        return resolve_obj_by_qualname(fake_cuda(case.capability).get_attn_backend_cls(forced, selector))


def layer_on(backend: type) -> SimpleNamespace:
    """A full-attention layer as vLLM builds it on ``backend`` (what the connector checks)."""
    return SimpleNamespace(impl=object.__new__(backend.get_impl_cls()), attn_backend=backend, sliding_window=None)


def evaluate(case: Case, model_dir: Path) -> Outcome:
    """Start the case as ``vllm-kvcomp serve`` and as the engine would (see the module doc)."""
    args, vllm_defaults = parse(model_dir, case.flags)
    try:
        cli.prepare(args, vllm_defaults, on_cpu=False)
        serve_message = ""
    except ValueError as err:
        serve_message = str(err)
    config = resolved_config(parse(model_dir, case.flags)[0])
    graphs = config.compilation_config.cudagraph_mode.name
    try:
        backend = selected_backend(case, config)
    except ValueError as err:
        return Outcome("none", graphs, VLLM_REFUSES, str(err), serve_message)
    message = support.startup_error(config, "cuda") or ""
    if not message:
        caches = {LAYER: torch.zeros(1, 1, BLOCK, 8)}
        try:
            assert paged_cache("cuda", {LAYER: layer_on(backend)}, caches, BLOCK) is CudaPagedCache
        except support.StartupError as err:
            message = str(err)
    return Outcome(backend.get_name(), graphs, REFUSED if message else COMPRESSES, message, serve_message)


def evaluate_all(cases: list[Case], model_dir: Path) -> dict[str, Outcome]:
    with cuda_selection():
        return {case.name: evaluate(case, model_dir) for case in cases}


def make_model_dir(directory: Path) -> Path:
    """A local model folder as far as ``vllm-kvcomp serve`` looks (config.json and a weights file)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (directory / "model.safetensors").write_bytes(b"\0" * 64)
    return directory


# ----------------------------------------------------------------------------- the table


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _flags(flags: tuple[str, ...]) -> str:
    return f"`{shlex.join(flags)}`" if flags else "(none)"


def table(outcomes: dict[str, Outcome]) -> str:
    """The generated section of docs/compatibility.md (markers included)."""
    lines = [
        START,
        f"Generated by `{COMMAND}` from `tests/engine/test_backend_choice.py`,",
        "which checks every row (a change of behaviour fails its test; CI fails when this table is stale).",
        "Do not edit by hand.",
        "",
        "What was run, on the CPU build of vLLM 0.32 (not on a GPU): vLLM's own CUDA attention-backend selector",
        "for each GPU's compute capability, with vllm-kvcomp's backends registered as on CUDA and FlashInfer",
        "installed (vLLM's CUDA image ships it); vLLM's own config resolution with the KVCompConnector, as on",
        "CUDA (static CUDA graphs, Model Runner V2); then vllm-kvcomp's start-up checks. The model is one",
        "full-attention layer of a plain decoder (head size 128, bfloat16, `--kv-cache-dtype auto`); *sinks*:",
        "with learned attention sinks, as gpt-oss. *compresses*: the backend is one vllm-kvcomp hooks and no",
        "setting is refused (what each model family does is the table above). *refused at start-up*: the",
        "engine stops as it starts (after loading the weights), with the message; *refused before vLLM starts*:",
        "`vllm-kvcomp serve` exits with status 2, the message after `error:`. The fix each message names is",
        "checked to compress (the same case with the fixed flags).",
        "",
        "| GPU (compute capability) | model | flags | backend vLLM picks | CUDA graphs | `vllm-kvcomp serve` "
        "| `vllm serve` with the KVCompConnector | message (`vllm-kvcomp serve`'s first) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        got = outcomes[case.name]
        gpu = f"{GPUS[case.capability]} ({case.capability[0]}.{case.capability[1]})"
        message = f"`{got.first_message}`" if got.first_message else "—"
        cells = [gpu, "sinks" if case.sinks else "plain", _flags(case.flags), got.backend, got.graphs,
                 got.serve_verdict, got.verdict, message]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join([*lines, END])


def section() -> str:
    """:func:`table` for every case (a throwaway model folder)."""
    with tempfile.TemporaryDirectory() as directory:
        return table(evaluate_all(CASES, make_model_dir(Path(directory) / "model")))


def rewrite(doc: str, generated: str) -> str:
    """``doc`` with the text between its markers replaced by ``generated`` (markers included)."""
    if START not in doc or END not in doc:
        raise ValueError(f"no generated GPU table markers in the document ({START} ... {END})")
    return doc[: doc.index(START)] + generated + doc[doc.index(END) + len(END):]


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("backend_choice") / "model")


@pytest.fixture(scope="module")
def outcomes(model_dir) -> dict[str, Outcome]:
    return evaluate_all(CASES, model_dir)


@pytest.mark.parametrize("name", list(CASE))
def test_case(outcomes, name):
    """The case gives what it must; a refusal by ``vllm-kvcomp serve`` says exactly what the
    engine would (one check, two places); vLLM's own refusal comes before ours."""
    case, got = CASE[name], outcomes[name]
    assert (got.verdict, bool(got.serve_message)) == (case.expected, case.early), got
    if got.verdict == COMPRESSES:
        assert got.message == "" and got.backend in backend_overrides("cuda")
    elif got.verdict == REFUSED:
        assert "KVCompConnector" in got.message and got.serve_message in ("", got.message)


@pytest.mark.parametrize("name", [case.name for case in CASES if case.fixed is not None])
def test_the_fix_a_refusal_names_compresses(outcomes, model_dir, name):
    case = CASE[name]
    assert case.names and case.names in outcomes[name].first_message
    with cuda_selection():
        fixed = evaluate(dataclasses.replace(case, flags=case.fixed, expected=COMPRESSES), model_dir)
    assert fixed.verdict == COMPRESSES, fixed


def test_vllm_picks_flashinfer_first_only_on_blackwell(outcomes):
    """The rows that motivate all this: FlashInfer is vLLM's first choice at compute capability
    10.x (refused), FlashAttention elsewhere from 8.0, Triton below it and with sinks below 9.0."""
    picked = {name: outcomes[name].backend for name in ("t4", "a100", "h100", "b200", "rtx-pro", "a100-sinks")}
    assert picked == {"t4": "TRITON_ATTN", "a100": "FLASH_ATTN", "h100": "FLASH_ATTN", "b200": "FLASHINFER",
                      "rtx-pro": "FLASH_ATTN", "a100-sinks": "TRITON_ATTN"}
    assert "Blackwell" in outcomes["b200"].message and outcomes["b200"].serve_verdict == REFUSED


def test_vllm_lowers_forced_full_graphs_to_piecewise_but_not_under_attention_fusion(outcomes):
    """The connector's ``requires_piecewise_for_cudagraph`` makes vLLM lower any FULL mode, a
    user-forced one too; the attention-quant fusion turns FULL graphs back on after that."""
    assert {outcomes[name].graphs for name in ("h100", "h100-full-graphs", "h100-full-decode-graphs")} == {"PIECEWISE"}
    assert outcomes["h100-attention-quant-fusion"].graphs == "FULL"


def test_the_table_is_current(outcomes):
    doc = DOC.read_text()
    assert START in doc and END in doc, f"docs/compatibility.md has no GPU table markers; regenerate: {COMMAND}"
    assert rewrite(doc, table(outcomes)) == doc, f"docs/compatibility.md's GPU table is stale; regenerate: {COMMAND}"


def test_the_cuda_stand_ins_leave_nothing_behind():
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends import registry

    overrides = dict(registry._ATTN_OVERRIDES)
    flashinfer = sys.modules.get("flashinfer")
    with cuda_selection(), cuda_config_resolution():
        assert current_platform.support_static_graph_mode() and "FLASH_ATTN" in {b.name for b in registry._ATTN_OVERRIDES}
    assert dict(registry._ATTN_OVERRIDES) == overrides and sys.modules.get("flashinfer") is flashinfer
    assert not current_platform.support_static_graph_mode()


def test_flashinfer_metadata_has_no_rows_to_trim():
    """Why FLASHINFER is refused, not hooked: its metadata holds host-planned wrappers (or the
    TRT-LLM paths' own tensors), no per-row lengths and block table the hook could trim after
    the builder ran (the other backends' ``with_lengths``). Fails when vLLM adds them."""
    with cuda_selection():
        from vllm.v1.attention.backends.flashinfer import FlashInferMetadata
    fields = {f.name for f in dataclasses.fields(FlashInferMetadata)}
    assert {"prefill", "decode"} <= fields and not fields & {"seq_lens", "block_table", "block_table_tensor"}


def test_the_attention_op_is_vllms_splitting_op():
    from vllm.config import CompilationConfig

    assert vllm_compat.ATTENTION_OP in CompilationConfig._attention_ops


# ----------------------------------------------------------------------------- support's checks, one by one


PER_KIND_FIX = "map full_attention to FLASH_ATTN in --attention-config.backend_per_kind"


@pytest.mark.parametrize(("backend", "per_kind", "refused", "fix"), [
    (None, None, None, None), ("auto", {}, None, None), ("flash_attn", None, None, None),
    ("TRITON_ATTN", {}, None, None),
    ("FLASHINFER", None, "--attention-backend FLASHINFER:", PASS_FA),
    ("flex_attention", {}, "--attention-backend FLEX_ATTENTION:", PASS_FA),
    ("FLASH_ATTN", {"full_attention": "FLASHINFER"}, "--attention-config.backend_per_kind full_attention FLASHINFER:",
     PER_KIND_FIX),
    ("FLASHINFER", {"sliding_window": "FLASHINFER", "full_attention": "TRITON_ATTN"}, None, None),
    ("FLASHMLA", None, None, None), ("flashinfer_mla", {}, None, None),  # MLA models: served uncompressed
])
def test_forced_backend_error(backend, per_kind, refused, fix):
    """Only full-attention layers' backend counts (vllm-kvcomp leaves sliding-window groups to
    vLLM); a per-kind choice wins over ``--attention-backend``, as in vLLM's selector."""
    error = support.forced_backend_error("cuda", backend, per_kind)
    assert error is None if refused is None else error.startswith(refused) and fix in error


def test_forced_backend_error_per_platform():
    assert support.forced_backend_error(None, "FLASHINFER", None) is None  # other platforms: the connector says why
    assert "pass --attention-backend CPU_ATTN," in support.forced_backend_error("cpu", "FLASH_ATTN", None)


def test_graph_error_spares_breakable_graphs(monkeypatch):
    from vllm.config.compilation import CUDAGraphMode

    pieces = SimpleNamespace(cudagraph_mode=CUDAGraphMode.PIECEWISE, splitting_ops=["vllm::unified_kv_cache_update"])
    assert "-cc.splitting_ops" in support.graph_error(pieces)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")  # attention breaks out of the capture
    assert support.graph_error(pieces) is None
    assert "PIECEWISE" in support.graph_error(SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL, splitting_ops=None))
    assert support.graph_error(SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE, splitting_ops=[])) is None


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_the_connector_refuses_to_start_on_what_support_refuses(role):
    """Both halves of the connector raise :class:`support.StartupError` on a config
    ``support.startup_error`` refuses, before anything else (``vllm serve`` has no flag check of
    its own): here the attention-quant fusion, which vLLM resolves to FULL graphs."""
    from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
    from vllm.config.compilation import PassConfig

    from vllm_kvcomp.engine.connector import KVCompConnector
    from vllm_kvcomp.vllm_compat import KVConnectorRole

    register_with_vllm()
    with cuda_config_resolution():
        config = VllmConfig(compilation_config=CompilationConfig(pass_config=PassConfig(fuse_attn_quant=True)),
                            kv_transfer_config=KVTransferConfig(**kv_transfer_config()))
    with pytest.raises(support.StartupError, match="fuse_attn_quant=false"):
        KVCompConnector(config, KVConnectorRole[role], None)


def test_a_cpu_engine_config_is_not_refused():
    """vLLM CPU's own resolution (no graphs, no micro-batching): nothing to refuse."""
    from vllm.config import KVTransferConfig, VllmConfig

    register_with_vllm()
    config = VllmConfig(kv_transfer_config=KVTransferConfig(**kv_transfer_config()))
    assert support.startup_error(config, "cpu") is None


def main() -> None:
    """Rewrite the generated GPU table of docs/compatibility.md."""
    DOC.write_text(rewrite(DOC.read_text(), section()))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
