"""The OpenAI-compatible server: ``vllm-kvcomp serve``, operator config, header middleware, metrics."""
