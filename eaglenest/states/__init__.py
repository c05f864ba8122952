"""The target's hidden states: samples split per shard, extraction (HF or vLLM) and packed shards."""
