"""Workflow plumbing that every stage shares: errors, atomic writes, JSONL input, config
validation, code fingerprints, GPU leases and running a stage. No torch at import time: the
Snakefile imports parts of it."""
