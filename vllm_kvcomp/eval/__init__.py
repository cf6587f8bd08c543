"""Quality harness: long-context tasks sent through an OpenAI-compatible server per policy.

``tasks`` generates seeded samples, ``runner`` sends them with the ``X-KV-Compression`` header and
appends JSONL, ``scoring`` checks replies, ``report`` writes the summary table and plots, and
``cli`` is ``vllm-kvcomp eval``. Heavy imports (openai, matplotlib, tokenizers) stay inside them.
"""
