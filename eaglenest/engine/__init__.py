"""The engine: vLLM started from the config (start), generation with its spec-decode counters
(generate), and one engine shared by every job of a phase (service)."""
