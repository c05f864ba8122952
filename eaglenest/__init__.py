"""eaglenest: train EAGLE-3 drafters for a target LLM, one file-based stage at a time.

The package never imports snakemake: every stage is a plain function, testable on its own.
"""
