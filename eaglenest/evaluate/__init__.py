"""Measuring the drafter: offline acceptance, acceptance in real vLLM checked against it, the summary."""
