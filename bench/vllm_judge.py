"""The vLLM judge that bench/recipe_ablation.py and bench/peer_speculators.py serve every drafter
with: the held-out prompts of a finished run, the target's own text on them once, then each drafter
in real vLLM at K, greedy text checked unchanged at temperature 0, vLLM's acceptance counted."""

import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEMO = REPO / "results"  # the finished run whose target, shards and prompts are served by default
K, MAX_TOKENS, CONCURRENCY = 3, 64, 8


def log_to(path):
    """Every log line of this process (vLLM's and eaglenest's) into `path` only."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True,
                        handlers=[logging.FileHandler(path, mode="w")])


def baseline(config, temperature=0.0, *, out, demo=DEMO, max_prompts=None):
    """The held-out prompts of the run in `demo` (at most `max_prompts`; None: all) and the
    target's text at `temperature`, under `out`, once for every drafter served on them."""
    from eaglenest.evaluate.online import vllm_baseline
    from eaglenest.evaluate.suites import write_suite_prompts
    prompts = out / "heldout.jsonl"
    if not prompts.exists():
        write_suite_prompts(prompts, "heldout", tokenized_path=demo / "data/tokenized_data.jsonl",
                            heldout_fraction=config["train"]["heldout_fraction"], max_prompts=max_prompts,
                            tokenize=None)
    outputs = out / f"baseline_outputs{suffix(temperature)}.jsonl"
    if not outputs.exists():
        vllm_baseline([prompts], demo / "target", out / f"baseline{suffix(temperature)}.json", outputs,
                      suites=["heldout"], temperatures=[temperature], concurrency=[CONCURRENCY],
                      max_tokens=MAX_TOKENS, seed=0, vllm=config["vllm"], trust_remote_code=False,
                      end_of_turn=config["tokenize"]["end_of_turn"])
    return prompts, outputs


def serve(config, drafter, prompts, outputs, runs_path, temperature=0.0, draft_sample_method="greedy", *, demo=DEMO):
    """`drafter` served with the target of `demo` in vLLM at K, on baseline()'s `prompts` at
    `temperature`, drafting by `draft_sample_method` (vLLM's runs into `runs_path`) -> its prompt
    count, whether it left the greedy text unchanged ("n/a" above temperature 0), the share of
    prompts whose greedy text it changed (reported here; evaluate_vllm judges each change on the
    target's logits: eaglenest.evaluate.greedy_identity) and vLLM's acceptance."""
    from eaglenest.evaluate.agreement import online_acceptance
    from eaglenest.evaluate.online import vllm_speculative
    runs = vllm_speculative([prompts], demo / "target", drafter, outputs, runs_path, num_speculative_tokens=K,
                            suites=["heldout"], temperatures=[temperature], concurrency=[CONCURRENCY],
                            max_tokens=MAX_TOKENS, seed=0, vllm=config["vllm"],
                            trust_remote_code=False, end_of_turn=config["tokenize"]["end_of_turn"],
                            draft_sample_method=draft_sample_method)
    run = runs["runs"][0]
    return {"prompts": run["prompts"], "greedy_text_unchanged": run.get("greedy_text_unchanged", "n/a"),
            "divergent_share": run.get("divergent_share"), **online_acceptance(run["counters"])}


def suffix(temperature, draft_sample_method="greedy"):
    """The result and baseline file names' suffix: none at temperature 0, none for greedy drafting
    (the names from before probabilistic drafting)."""
    return ("" if temperature == 0 else f"_t{temperature:g}") + (
        "" if draft_sample_method == "greedy" else f"_{draft_sample_method}")
