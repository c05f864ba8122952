"""Benchmark: the training recipe, one difference at a time, served in real vLLM.

On the hidden states, vocab, tokenized data and target of an earlier `make demo` (results/), each
variant trains with the demo config's data, steps and geometry, changing only the recipe settings
it names (VARIANTS; "a+b" applies both), into results/recipe/<variant>_s<seed>/. Each drafter is
then served in vLLM at K = 3, greedy, on every held-out prompt of the demo (the heldout suite with
no max_prompts), 64 tokens each, 8 requests at once; the baseline (the target alone, the same
prompts) runs once, and speculation must leave its greedy text unchanged (vLLM's CPU build in
float32 is bit-exact). Each variant runs in a fresh process (one vLLM engine each) and leaves its
figures in result.json, so an interrupted benchmark resumes where it stopped. Per variant:
training steps and seconds per step, vLLM's acceptance per position, mean acceptance length.
`--temperature 1`: the drafters already trained served again at temperature 1 (each request
seeded by its prompt, as eval.seed does), against a baseline of its own (result_t1.json).
`--draft-sample-method probabilistic` (above temperature 0): vLLM samples each draft from the
drafter's distribution and accepts it with min(1, p/q) instead of drafting its argmax
(result_t1_probabilistic.json beside the greedy result_t1.json; the baseline is shared). Each
drafter is trained at the temperature the workflow would fit (train.temperature, null: the demo's
largest eval.temperatures above 0, 1.0), whatever it is served at.

    .venv/bin/python bench/recipe_ablation.py                      # every VARIANTS entry, seed 0
    .venv/bin/python bench/recipe_ablation.py --variants ours,norms+muon --seeds 0,1
    .venv/bin/python bench/recipe_ablation.py --variants ours,muon --seeds 0,1 --temperature 1
    .venv/bin/python bench/recipe_ablation.py --variants tv,tv_half --temperature 1 --draft-sample-method probabilistic
"""

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

import yaml

from vllm_judge import DEMO, REPO, baseline, log_to, serve, suffix  # first: it puts this checkout on sys.path

from eaglenest.workflow.atomic import atomic_path
from eaglenest.workflow.serving import fitted_temperature

OUT = REPO / "results/recipe"

# Each: (train: overrides, drafter: overrides), from OURS toward speculators 0.9.0's defaults.
# OURS is the recipe every earlier table measured (AdamW, no TV term), fixed here so that those
# rows stay reproducible; config.yaml's default since issue 43 is "muon+tv+norms". KL against soft CE is
# no variant: they differ by the target's entropy, a constant to the drafter, so their gradients
# are the same.
OURS = ({"optimizer": "adamw", "weight_decay": 0.0, "schedule": "cosine", "warmup": 20, "max_grad_norm": 0.5,
         "step_weight_decay": 0.8, "supervise": "in_draft_vocab", "tv_weight": 0.0, "init_std": None,
         "train_lm_head": True, "muon_lr": None, "adamw_betas": [0.9, 0.95], "mask_alignment": "predicted",
         "length_sorted": True, "packed_steps": False, "warmup_from_zero": False},
        {"norm_before_residual": False, "norm_before_fc": False, "norm_output": False})


def times_lr(factor):
    """A setting of `factor` x the run's `lr`, whatever it is (settings() resolves it)."""
    return lambda train: factor * train["lr"]


VARIANTS = {
    "ours": ({}, {}),
    "muon": ({"optimizer": "muon", "weight_decay": 0.01, "muon_weight_decay": 0.1}, {}),  # muon_lr None: lr
    "linear": ({"schedule": "linear", "warmup": 21, "max_grad_norm": 1.0}, {}),  # 1% of the demo's 2,196 steps, rounded down
    "equal_steps": ({"step_weight_decay": 1.0}, {}),
    "supervise_all": ({"supervise": "all"}, {}),
    "frozen_lm_head": ({"train_lm_head": False}, {}),
    "norms": ({}, {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}),
    "norm_before_fc": ({}, {"norm_before_fc": True}),
    "norm_output": ({}, {"norm_output": True}),
    "norm_before_residual": ({}, {"norm_before_residual": True}),
    "init": ({"init_std": 0.02}, {}),  # speculators' N(0, 0.02) (transformers' _init_weights, initializer_range)
    "betas": ({"adamw_betas": [0.9, 0.999]}, {}),  # torch's default, which speculators' AdamW keeps
    "input_mask": ({"mask_alignment": "input"}, {}),  # speculators' shift_batch: the input token's mask
    "shuffled": ({"length_sorted": False}, {}),  # a step of samples in random order, as their sampler
    # their step: one packed batch of consecutive shuffled samples, 565 tokens at most, prompts
    # included (the total_seq_len bench/peer_speculators.py matched to our steps: 2,199 and 2,197
    # here against 2,196), each step normalised over its own positions as their per-batch means
    "packed": ({"packed_steps": True, "tokens_per_step": 565}, {}),
    "warmup_from_zero": ({"warmup_from_zero": True}, {}),  # transformers' warmup: step 0 at lr 0
    # not differences from speculators: Muon at 5 and 20 x lr (the first ablation's mistaken
    # "default" of 10 x lr, halved and doubled)
    "muon_5lr": ({"muon_lr": times_lr(5)}, {}),
    "muon_20lr": ({"muon_lr": times_lr(20)}, {}),
    # nor these: the total variation distance beside the soft CE (docs/RECIPE.md)
    "tv": ({"tv_weight": 1.0}, {}),
    "tv_half": ({"tv_weight": 0.5}, {}),
    "tv_double": ({"tv_weight": 2.0}, {}),
    # Muon at twice and half `lr`, over the adopted muon+tv+norms (theirs: `muon_lr` = `lr`)
    "muon_2lr": ({"muon_lr": times_lr(2)}, {}),
    "muon_half_lr": ({"muon_lr": times_lr(0.5)}, {}),
    "muon_no_decay": ({"muon_weight_decay": 0.0}, {}),  # theirs: 0.1
}
THEIRS = ("muon", "linear", "equal_steps", "supervise_all", "frozen_lm_head", "norms", "init", "betas", "input_mask",
          "shuffled")
VARIANTS["theirs"] = tuple(  # every difference at once: speculators 0.9.0's defaults
    {key: value for name in THEIRS
     for key, value in VARIANTS[name][part].items()} for part in (0, 1))


def settings(variant, config):
    """(train settings, drafter geometry) of a variant name ("a+b": both), the temperature
    resolved as the workflow resolves it, settings relative to `lr` (times_lr) as numbers."""
    train = dict(config["train"]) | {"temperature": fitted_temperature(config)} | OURS[0]
    drafter = dict(config["drafter"]) | OURS[1]
    for name in variant.split("+"):
        train_overrides, drafter_overrides = VARIANTS[name]
        train |= train_overrides
        drafter |= drafter_overrides
    return {key: value(train) if callable(value) else value for key, value in train.items()}, drafter


def demo_config():
    return yaml.safe_load((REPO / "config.yaml").read_text())


def run_variant(variant, seed, cores, temperature=0.0, draft_sample_method="greedy"):
    """Train one variant at one seed (unless done) and serve it at `temperature`, drafting by
    `draft_sample_method`: results/recipe/<variant>_s<seed>/result.json (result_t1.json at
    temperature 1, result_t1_probabilistic.json drafting probabilistically)."""
    import torch
    from eaglenest.train.loop import train_drafter
    torch.set_num_threads(cores)
    config = demo_config()
    root = OUT / f"{variant}_s{seed}"
    root.mkdir(parents=True, exist_ok=True)
    served = suffix(temperature, draft_sample_method)
    log_to(root / f"log{served}.txt")
    train, drafter = settings(variant, config)
    prompts, outputs = baseline(config, temperature, out=OUT)
    shards = sorted(str(p) for p in (DEMO / "hidden_states").glob("shard_*.safetensors"))
    train |= {"seed": seed, "device": "cpu"}
    if not (root / "drafter").exists():
        train_drafter(shards, DEMO / "hidden_states/manifest.json", DEMO / "vocab/d2t.pt", DEMO / "vocab/t2d.pt",
                      DEMO / "target", root / "drafter", root / "train_log.tsv", drafter_geometry=drafter, **train)
    rows = list(csv.DictReader(open(root / "train_log.tsv"), delimiter="\t"))
    result = {"variant": variant, "seed": seed, "temperature": temperature,
              "draft_sample_method": draft_sample_method, "steps": int(rows[-1]["step"]),
              "train_s": float(rows[-1]["elapsed_s"]),
              **serve(config, root / "drafter", prompts, outputs, root / f"vllm{served}.json", temperature,
                      draft_sample_method)}
    with atomic_path(root / f"result{served}.json") as tmp:  # resuming trusts a result that is there: whole or none
        tmp.write_text(json.dumps(result, indent=1) + "\n")


def table(results):
    print("| recipe | seed | T | drafts | steps | s/step | acceptance per position (vLLM, K=3) "
          "| mean acceptance length | greedy text unchanged |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        rates = " / ".join(f"{a:.3f}" for a in r["acceptance_rate_per_position"])
        print(f"| {r['variant']} | {r['seed']} | {r.get('temperature', 0):g} "
              f"| {r.get('draft_sample_method', 'greedy')} | {r['steps']:,} "
              f"| {r['train_s'] / r['steps']:.3f} | {rates} "
              f"| **{r['mean_acceptance_length']:.3f}** | {r['greedy_text_unchanged']} ({r['prompts']} prompts) |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="VARIANTS names, comma-separated; a+b: both")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"], default="greedy",
                        help="vLLM's speculative_config.draft_sample_method")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.draft_sample_method == "probabilistic" and args.temperature == 0:
        parser.error("--draft-sample-method probabilistic needs --temperature above 0 (at 0 vLLM drafts the argmax)")
    if args.one:
        return run_variant(args.one[0], int(args.one[1]), args.cores, args.temperature, args.draft_sample_method)
    if not (DEMO / "hidden_states/manifest.json").is_file():
        sys.exit("results/hidden_states is missing: run `make demo` first")
    results = []
    for variant in args.variants.split(","):
        for seed in map(int, args.seeds.split(",")):
            path = OUT / f"{variant}_s{seed}/result{suffix(args.temperature, args.draft_sample_method)}.json"
            if not path.exists():
                subprocess.run([sys.executable, __file__, "--one", variant, str(seed), "--cores", str(args.cores),
                                "--temperature", str(args.temperature),
                                "--draft-sample-method", args.draft_sample_method], check=True)
                print(f"{variant} seed {seed} done", file=sys.stderr, flush=True)
            results.append(json.loads(path.read_text()))
    table(results)


if __name__ == "__main__":
    main()
