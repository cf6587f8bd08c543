"""Quality harness: long-context tasks sent through an OpenAI-compatible server per policy.

``tasks`` generates seeded samples, ``runner`` sends them with the ``X-KV-Compression`` header and
appends JSONL, ``scoring`` checks replies, ``cells`` aggregates them with Wilson intervals
(``stats``), ``claims`` holds the papers' claims and their verdicts, ``report`` writes the summary
and ``plots`` the PNGs, and ``cli`` is ``vllm-kvcomp eval``. ``probe`` (NIAH attention probe on
the HF oracle) and ``policy_table`` (docs/policies.md's table) are tools for the docs. Heavy
imports (openai, matplotlib, tokenizers, transformers) stay inside them.
"""
