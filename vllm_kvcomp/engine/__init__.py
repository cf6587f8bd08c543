"""vLLM integration: KV connector (scheduler <-> worker), attention backends, compaction."""
