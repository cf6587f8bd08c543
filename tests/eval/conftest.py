"""Fixtures for the eval harness: fake essays, small tokenizers and a fake OpenAI server.

The fake server "compresses" by keeping only the last ``ratio`` fraction of the words of the
first user message (a crude StreamingLLM), answers the task's question from what it kept, echoes
``X-KV-Compression`` as ``X-KV-Compression-Applied`` and reports ``usage.kv_compression``.
Requests whose header names ``policy=h2o`` are rejected with HTTP 400.
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vllm_kvcomp.eval.tasks.sizing import TokenCounter, TokenizersCounter

WORDS = ("the", "startup", "founders", "investors", "idea", "work", "people", "good", "time",
         "make", "company", "think", "users", "money", "hard", "essay", "write", "build",
         "program", "language", "lisp", "growth", "market", "product", "really", "because",
         "something", "never", "always", "better", "school", "smart", "wealth", "design")


class WhitespaceCounter(TokenCounter):
    """One token per whitespace-separated word: exact and additive, for placement checks."""

    def count_many(self, texts: Sequence[str]) -> list[int]:
        return [len(t.split()) for t in texts]


def fake_essay(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 18))]
        out.append(" ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!")))
    text = " ".join(out)
    return "\n".join(text[i:i + 70] for i in range(0, len(text), 70))  # hard-wrapped like the real set


@pytest.fixture(scope="session")
def essay_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("essays")
    rng = random.Random(7)
    for i in range(6):
        (folder / f"essay{i:02d}.txt").write_text(fake_essay(rng, 120), encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory, essay_dir: Path) -> Path:
    """A tiny byte-level BPE trained on the fake essays plus digits, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [p.read_text() for p in sorted(essay_dir.glob("*.txt"))] + ["0123456789 " * 20]
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def whitespace_counter() -> TokenCounter:
    return WhitespaceCounter()


@pytest.fixture(scope="session")
def bpe_counter(tokenizer_json: Path) -> TokenCounter:
    return TokenizersCounter.from_file(tokenizer_json)


def _tail(text: str, ratio: float) -> str:
    words = text.split()
    return " ".join(words[len(words) - math.ceil(ratio * len(words)):])


def answer(visible: str, question: str) -> str:
    """Answer ``question`` from the ``visible`` (kept) part of the prompt."""
    if "pass key" in question:
        found = re.search(r"pass key is (\d+)", visible)
        return f"The pass key is {found.group(1)}." if found else "I do not know."
    if "magic number" in question:
        keys = re.findall(r"[a-z]+-[a-z]+", question.split("for", 1)[1])
        hits = [re.search(rf"numbers for {k} is: (\d+)", visible) for k in keys]
        return "; ".join(f"{k}: {h.group(1)}" for k, h in zip(keys, hits) if h) or "None."
    name = re.search(r"What is (\w+)'s favorite number", question)
    found = name and re.search(rf"{name.group(1)}'s favorite number is (\d+)", visible)
    return f"It is {found.group(1)}." if found else "I do not know."


def reply_chat(messages: list[dict[str, str]], ratio: float) -> str:
    """Compress the first message to its tail; later turns stay whole."""
    visible = " ".join([_tail(messages[0]["content"], ratio)] + [m["content"] for m in messages[1:]])
    return answer(visible, messages[-1]["content"])


def reply_completion(prompt: str, ratio: float) -> str:
    return answer(_tail(prompt, ratio), prompt.rsplit("User:", 1)[-1])


class FakeServer:
    """Records every request; ``url`` is the server root."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                header = self.headers.get("X-KV-Compression", "")
                with server.lock:
                    server.requests.append({"path": self.path, "header": header, "body": body})
                if "h2o" in header:
                    self._send(400, {"error": {"message": "policy h2o rejected", "code": 400}}, {})
                    return
                ratio_m = re.search(r"ratio=([\d.]+)", header)
                ratio = float(ratio_m.group(1)) if ratio_m else 1.0
                if self.path.endswith("/chat/completions"):
                    reply = reply_chat(body["messages"], ratio)
                    choice = {"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": reply}}
                else:
                    reply = reply_completion(body["prompt"], ratio)
                    choice = {"index": 0, "finish_reason": "stop", "text": reply}
                usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                         "kv_compression": {"policy": "echo", "kept_fraction": ratio}}
                payload = {"id": "x", "object": "chat.completion", "created": 0,
                           "model": body["model"], "choices": [choice], "usage": usage}
                self._send(200, payload, {"X-KV-Compression-Applied": header})

            def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    with FakeServer() as server:
        yield server
