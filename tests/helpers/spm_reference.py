"""llama.cpp's SentencePiece (``llama``) tokenizer in plain Python: the reference the converted
``tokenizer.json`` of a Gemma GGUF must reproduce id for id.

A port of ``llama_vocab::tokenize`` for ``LLAMA_VOCAB_TYPE_SPM`` with ``parse_special``: control,
user-defined and unknown tokens are cut out of the raw text first (longest first, left to right);
each remaining piece has its spaces written as ``▁`` and is split into characters, then the
adjacent pair whose concatenation is the vocabulary token of highest score (leftmost on ties) is
merged until none is left (``llm_tokenizer_spm_session``); a character outside the vocabulary
becomes its ``<0xXX>`` byte tokens. Checked against llama.cpp itself on 2270 texts for Gemma 3
270M's vocabulary (a one-off check, not kept in the repository).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

#: llama.cpp token types cut out of the text before the merges: unknown, control, user-defined
MATCHED_WHOLE = (2, 3, 4)


class SentencePieceReference:
    """``encode(text)`` as llama.cpp tokenizes with ``add_special`` and ``parse_special``."""

    def __init__(self, tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                 bos_id: int | None = None):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.scores = list(scores)
        self.bos_id = bos_id
        whole = [i for i, kind in enumerate(types) if kind in MATCHED_WHOLE]
        self.whole = sorted(whole, key=lambda i: -len(tokens[i].encode()))
        self.tokens = list(tokens)

    def encode(self, text: str) -> list[int]:
        fragments: list[str | int] = [text]
        for token_id in self.whole:
            piece = self.tokens[token_id]
            cut: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or piece not in fragment:
                    cut.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(piece)):
                    if k:
                        cut.append(token_id)
                    if part:
                        cut.append(part)
            fragments = cut
        out = [] if self.bos_id is None else [self.bos_id]
        for fragment in fragments:
            out.extend([fragment] if isinstance(fragment, int) else self._merge(fragment.replace(" ", "\u2581")))
        return out

    def _merge(self, text: str) -> list[int]:
        symbols = list(text)
        size = [len(s.encode()) for s in symbols]
        nxt = [*range(1, len(symbols)), -1]
        prev = list(range(-1, len(symbols) - 1))
        queue: list[tuple[float, int, int, int]] = []

        def add(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            joined = symbols[left] + symbols[right]
            token = self.ids.get(joined)
            if token is not None:
                heapq.heappush(queue, (-self.scores[token], left, right, len(joined.encode())))

        for i in range(1, len(symbols)):
            add(i - 1, i)
        while queue:
            _, left, right, length = heapq.heappop(queue)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue  # one side was merged since
            symbols[left] += symbols[right]
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])
        out: list[int] = []
        i = 0 if symbols else -1
        while i != -1:
            token = self.ids.get(symbols[i])
            out.extend([token] if token is not None else
                       [self.ids[f"<0x{b:02X}>"] for b in symbols[i].encode()])
            i = nxt[i]
        return out
