"""``scope=context`` on the server: where a chat's context ends (the bundled model's tokenizer and
chat template), and what the protocol does without ``context_tokens`` (no engine)."""

from __future__ import annotations

import pytest

from vllm_kvcomp.models import fetch_default_model
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.server import protocol
from vllm_kvcomp.server.context import ContextCounter
from vllm_kvcomp.server.operator_config import OperatorConfig
from vllm_kvcomp.spec import CompressionSpec

CONTEXT = "The vault code is 4417. " * 30


@pytest.fixture(scope="module")
def counter() -> ContextCounter:
    return ContextCounter(str(fetch_default_model()))


def chat(question: str, system: bool = True) -> dict:
    messages = [{"role": "user", "content": CONTEXT}, {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": question}]
    return {"messages": ([{"role": "system", "content": "Be brief."}] if system else []) + messages}


def test_context_is_every_token_before_the_last_user_message(counter):
    tokenizer = counter.tokenizer()
    counts = []
    for question in ("What is the vault code?", "Repeat the first sentence, then say what the code is."):
        body = chat(question)
        count = counter(body)
        whole = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(whole, add_special_tokens=False)["input_ids"]  # as vLLM tokenizes a chat
        before = tokenizer.apply_chat_template(body["messages"][:-1], tokenize=False)
        assert tokenizer.decode(ids[:count]) == before
        assert tokenizer.decode(ids[count:]).startswith("<|im_start|>user\n" + question)
        counts.append(count)
    assert counts[0] == counts[1] > 300


def test_text_parts_count_as_their_text(counter):
    body = chat("What is the vault code?")
    parts = dict(body, messages=[dict(m, content=[{"type": "text", "text": m["content"]}]) for m in body["messages"]])
    assert counter(parts) == counter(body)


def test_a_chat_without_context_or_with_other_content_is_refused(counter):
    assert counter({"messages": [{"role": "user", "content": "hi"}]}) == 0
    config = OperatorConfig.default()
    with pytest.raises(protocol.RequestError) as err:
        protocol.resolve(config, ["policy=snapkv; scope=context"], {"messages": [{"role": "user", "content": "hi"}]},
                         protocol.CHAT_ROUTE, counter)
    assert err.value.param == "X-KV-Compression.scope" and "earlier messages" in err.value.message
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}
    with pytest.raises(SpecError, match="non-text"):
        counter({"messages": [image, {"role": "user", "content": "what is it?"}]})


def test_a_tokenizer_or_template_that_fails_on_the_chat_is_a_400_naming_scope(tmp_path):
    """A template raising on this chat (roles must alternate) or a tokenizer that cannot load:
    the client's request cannot be counted, a SpecError (HTTP 400), never a 500."""
    strict = ContextCounter(str(fetch_default_model()),
                            "{% for m in messages %}{% if loop.index0 % 2 == 0 and m.role != 'user' %}"
                            "{{ raise_exception('roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}")
    body = {"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}
    with pytest.raises(SpecError, match="roles must alternate") as err:
        strict(body)
    assert err.value.field == "scope" and "context_tokens" in err.value.allowed
    with pytest.raises(SpecError, match="could not count the context tokens") as err:
        ContextCounter(str(tmp_path / "no-tokenizer-here"))(chat("What is the code?"))
    assert err.value.field == "scope"


def test_resolve_fills_context_tokens_on_chat_and_asks_for_them_elsewhere(counter):
    config = OperatorConfig.default()
    body = chat("What is the vault code?")
    spec = protocol.resolve(config, ["policy=snapkv; ratio=0.25; scope=context"], body, protocol.CHAT_ROUTE, counter)
    assert spec.extras["context_tokens"] == counter(body) and "context_tokens=" in spec.to_header()
    given = protocol.resolve(config, [], dict(body, kv_compression={"policy": "snapkv", "scope": "context",
                                                                    "context_tokens": 7}), protocol.CHAT_ROUTE, counter)
    assert given.extras["context_tokens"] == 7
    with pytest.raises(protocol.RequestError) as err:
        protocol.resolve(config, [], {"prompt": "x", "vllm_xargs": {"kvcomp_policy": "snapkv", "kvcomp_scope": "context"}},
                         protocol.COMPLETION_ROUTE, counter)
    assert err.value.param == "vllm_xargs.kvcomp_context_tokens" and "/tokenize" in err.value.message
    plain = protocol.resolve(config, ["policy=snapkv"], {"prompt": "x"}, protocol.COMPLETION_ROUTE, counter)
    assert plain == CompressionSpec.from_mapping({"policy": "snapkv"})
