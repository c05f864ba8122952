"""eaglenest: train EAGLE-3 drafters for a target LLM, one file-based stage at a time.

Subpackages follow the data (docs/ARCHITECTURE.md): workflow (plumbing) <- engine (vLLM) <- data
(prompts, responses, tokens, vocab) <- states (hidden-state shards) <- drafter <- train, evaluate;
demo builds the built-in target. The package never imports snakemake: every stage is a plain
function, testable on its own.
"""

from pathlib import Path

# The folder holding this eaglenest: what processes the stages start (vLLM workers, torchrun)
# must import, never an installed copy of another checkout.
CHECKOUT = Path(__file__).resolve().parent.parent
