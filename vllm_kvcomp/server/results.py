"""Per-request compression results in the API server, for streamed and non-streamed responses.

When a compressed request finishes, the engine puts its numbers into the request's
``kv_transfer_params["kvcomp"]`` (see ``RequestStats.as_params`` in engine/scheduler.py). vLLM
copies those into non-streaming responses only, and only for the first prompt of a completion
batch. :class:`ResultTap` therefore wraps the engine client's ``generate`` once and keeps the
result of every finished request by request id until the middleware collects it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from typing import Any

from vllm_kvcomp import vllm_compat
from vllm_kvcomp.server.protocol import uncompressed_result

Result = dict[str, Any]
TAP_ATTRIBUTE = "_kvcomp_result_tap"


class ResultTap:
    """Finished-request results by request id (oldest dropped beyond ``capacity``)."""

    def __init__(self, capacity: int = 4096, kv_cache_tokens: int | None = None):
        self._capacity = capacity
        self._results: OrderedDict[str, Result] = OrderedDict()
        self.kv_cache_tokens = kv_cache_tokens  # set when max_model_len may exceed the KV cache

    @classmethod
    def install(cls, engine_client: Any) -> ResultTap:
        """Wrap ``engine_client.generate`` (once per client, see vllm_compat's ledger) and return the tap."""
        tap = getattr(engine_client, TAP_ATTRIBUTE, None)
        if tap is None:
            tap = cls(kv_cache_tokens=vllm_compat.long_prompt_kv_cache_tokens(engine_client))
            vllm_compat.wrap_engine_generate(engine_client, tap.wrap)
            setattr(engine_client, TAP_ATTRIBUTE, tap)
        return tap

    def check_fits(self, prompt: Any, sampling_params: Any) -> None:
        """With ``--allow-prompts-beyond-kv-cache``: a prompt the KV cache cannot hold whole is
        refused (HTTP 400, as vLLM refuses one beyond max_model_len) unless it is compressed
        during prefill."""
        if self.kv_cache_tokens is None:
            return
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else getattr(prompt, "prompt_token_ids", None)
        extra = getattr(sampling_params, "extra_args", None) or {}
        if ids is None or len(ids) + 1 <= self.kv_cache_tokens or extra.get("kvcomp_prefill") in ("stream", "block"):
            return
        raise vllm_compat.validation_error(
            f"This prompt has {len(ids)} tokens but the KV cache holds {self.kv_cache_tokens}: only a request "
            "compressed during prefill can use it (e.g. X-KV-Compression: policy=streamingllm; ratio=0.25; "
            "prefill=stream, or policy=snapkv; ratio=0.25; prefill=block)", parameter="prompt")

    def wrap(self, generate: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., AsyncGenerator[Any, None]]:
        """``generate`` that records each request's result when its final output passes."""

        async def tapped(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
            request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
            self.check_fits(kwargs.get("prompt", args[0] if args else None),
                            kwargs.get("sampling_params", args[1] if len(args) > 1 else None))
            outputs = generate(*args, **kwargs)
            prompt_tokens = 0
            try:
                async for output in outputs:
                    if output.prompt_token_ids is not None:
                        prompt_tokens = len(output.prompt_token_ids)
                    if output.finished and request_id is not None:
                        self.record(request_id, output.kv_transfer_params, prompt_tokens)
                    yield output
            finally:
                await outputs.aclose()  # a cancelled stream aborts the request right away

        return tapped

    def record(self, request_id: str, kv_transfer_params: dict[str, Any] | None, prompt_tokens: int) -> None:
        result = (kv_transfer_params or {}).get("kvcomp")
        if result is None:
            result = uncompressed_result(prompt_tokens)
        self._results[request_id] = result
        while len(self._results) > self._capacity:
            self._results.popitem(last=False)

    def pop(self, request_id: str) -> Result | None:
        return self._results.pop(request_id, None)

    def pop_numbered(self, response_id: str, separator: str) -> list[Result]:
        """Results of a response whose engine requests ran as ``<id><separator>0``, ``...1``, ...:
        the prompts of a completion (``-``), a batch's conversations or a Responses API turn's
        engine calls (``_``)."""
        results = []
        while (result := self.pop(f"{response_id}{separator}{len(results)}")) is not None:
            results.append(result)
        return results
