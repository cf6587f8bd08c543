"""Where a chat's context ends (``scope=context``): the prompt tokens before its last user message.

The chat is rendered with the model's chat template twice, whole (as vLLM renders it) and up to
its last user message; the context is every token of the whole prompt that lies inside the
shorter rendering. The last user message and the generation prompt are the question: neither
compressed nor used as observation queries.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_kvcomp.params import SpecError

NOT_A_PREFIX = ("this model's chat template does not render the messages before the last user message as a "
                "prefix of the whole chat, so the server cannot tell where the context ends")


class ContextCounter:
    """Counts a chat body's context tokens with the served model's tokenizer (loaded on first use)."""

    def __init__(self, tokenizer_source: str, chat_template: str | None = None):
        self.source = tokenizer_source
        self.chat_template = _template(chat_template)
        self._tokenizer: Any = None

    def __call__(self, body: Mapping[str, Any]) -> int:
        messages = [_text_message(m, i) for i, m in enumerate(body["messages"])]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users or users[-1] == 0:
            return 0
        try:
            return self._count(body, messages, users[-1])
        except SpecError:
            raise
        except Exception as err:  # the tokenizer or template failed on this chat: the client's to fix
            raise SpecError("scope", f"context: the server could not count the context tokens with the model's "
                            f"tokenizer and chat template ({type(err).__name__}: {err})",
                            "all, or context_tokens given by the client") from err

    def _count(self, body: Mapping[str, Any], messages: list[dict[str, str]], last_user: int) -> int:
        tokenizer = self.tokenizer()
        kwargs = dict(body.get("chat_template_kwargs") or {})
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        generation = body.get("add_generation_prompt", True) and not body.get("continue_final_message", False)
        whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kwargs)
        before = tokenizer.apply_chat_template(messages[:last_user], tokenize=False, add_generation_prompt=False,
                                               **kwargs)
        if not whole.startswith(before):
            raise SpecError("context_tokens", NOT_A_PREFIX,
                            "an integer: the prompt's leading tokens that are the context")
        offsets = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return sum(1 for _, end in offsets if end <= len(before))

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.source)
        return self._tokenizer


def _template(chat_template: str | None) -> str | None:
    """vLLM's ``--chat-template``: a file's path or the template itself."""
    if chat_template is None:
        return None
    path = Path(chat_template)
    return path.read_text() if path.is_file() else chat_template


def _text_message(message: Any, index: int) -> dict[str, str]:
    """``{"role", "content"}`` of one message, text parts joined; SpecError for other content."""
    field = f"messages[{index}]"
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise SpecError("scope", f"context: {field} is not a message with a role", "all")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return {"role": message["role"], "content": content or ""}
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return {"role": message["role"], "content": "".join(str(p.get("text", "")) for p in content)}
    raise SpecError("scope", f"context: {field} has non-text content, whose tokens the server cannot count here",
                    "all, or context_tokens given by the client")
