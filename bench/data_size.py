"""Benchmark: how the drafter's acceptance grows with its training data, on a finished run.

A run's hidden states come in shards of about equal size (samples go to shards by a hash of
their id), so 1, 2, ... of them are nested training sets of growing size. This trains a drafter
on the training samples of the first n shards, for each n of --shards, with the run's own
training settings (config.yaml overlaid with --configfile's, as Snakemake merges them; --epochs
may replace its epochs, the same for every size), and evaluates each on the held-out samples of
every shard (the same prompts for all sizes). Acceptance is the offline evaluation's at vLLM's anchors, at temperature 0: on greedy data
it is what vLLM counts (the run's evaluate_vllm checks that). Training accuracy at its last
logged steps against held-out acceptance at position 1 says how far each size overfits.

    .venv/bin/python bench/data_size.py --configfile configs/smollm2.yaml --epochs 2   # after make smollm2 (~25 min)
"""

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eaglenest.data.samples import is_heldout  # noqa: E402
from eaglenest.evaluate.offline import evaluate_offline  # noqa: E402
from eaglenest.states.shards import ShardSamples  # noqa: E402
from eaglenest.train.loop import train_drafter  # noqa: E402
from eaglenest.workflow.serving import fitted_temperature  # noqa: E402

# train: keys that shape the drafter (and train.temperature, resolved as the rule resolves it)
TRAINING = ("seed", "ttt_steps", "step_weight_decay", "epochs", "max_tokens_per_batch", "tokens_per_step", "lr",
            "warmup", "schedule", "optimizer", "weight_decay", "muon_lr", "muon_weight_decay", "max_grad_norm",
            "supervise", "tv_weight", "train_lm_head", "heldout_fraction", "init_from", "device", "bf16")


def merged(base, overlay):
    """`overlay` over `base`, section by section, as Snakemake merges --configfile."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def last_accuracy(train_log, rows=3):
    """The mean step-1 training accuracy over the log's last `rows` rows (each a mean over log_every steps)."""
    with open(train_log) as f:
        tail = list(csv.DictReader(f, delimiter="\t"))[-rows:]
    column = next(c for c in tail[0] if c.startswith("acc"))
    return sum(float(r[column]) for r in tail) / len(tail)


def evaluate(results, shards, drafter, config, out):
    metrics = evaluate_offline(shards, results / "hidden_states/manifest.json", drafter, results / "target", out,
                               heldout_fraction=config["train"]["heldout_fraction"],
                               num_speculative_tokens=max(config["eval"]["num_speculative_tokens"]))
    return metrics["served"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configfile", default="configs/smollm2.yaml")
    parser.add_argument("--shards", default="1,2,4", help="training sizes, in shards")
    parser.add_argument("--epochs", type=int, help="instead of the config's train.epochs")
    parser.add_argument("--results", help="the run's results folder, if not the config's (e.g. a fresh clone's)")
    args = parser.parse_args()
    config = merged(yaml.safe_load((REPO / "config.yaml").read_text()),
                    yaml.safe_load((REPO / args.configfile).read_text()))
    results = Path(args.results) if args.results else REPO / config["results"]
    shards = sorted((results / "hidden_states").glob("shard_*.safetensors"))
    train = ({key: config["train"][key] for key in TRAINING} | {"temperature": fitted_temperature(config)}
             | ({"epochs": args.epochs} if args.epochs else {}))
    fraction = train["heldout_fraction"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in args.shards.split(",")]:
            samples = ShardSamples(shards[:n], keep=lambda i: not is_heldout(i, fraction))
            drafter, log_path = Path(tmp) / f"drafter_{n}", Path(tmp) / f"train_{n}.tsv"
            start = time.perf_counter()
            train_drafter(shards[:n], results / "hidden_states/manifest.json", results / "vocab/d2t.pt",
                          results / "vocab/t2d.pt", results / "target", drafter, log_path,
                          drafter_geometry=config["drafter"], **train)
            seconds = time.perf_counter() - start
            served = evaluate(results, shards, drafter, config, Path(tmp) / f"offline_{n}.json")
            rows.append((n, len(samples), samples.num_tokens(), seconds, last_accuracy(log_path), served))
            print(f"{n} shards done", file=sys.stderr, flush=True)
    K = max(config["eval"]["num_speculative_tokens"])
    print(f"{train['epochs']} epochs at every size")
    print(f"| shards | training samples | training tokens | training time | training accuracy, step 1 "
          f"| held-out acceptance per position (K={K}) | mean acceptance length | ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    for n, count, tokens, seconds, accuracy, served in rows:
        rates = " / ".join(f"{a:.3f}" for a in served["acceptance_rate_per_position"])
        ceiling = " / ".join(f"{a:.3f}" for a in served["ceiling_per_position"])
        print(f"| {n} of {len(shards)} | {count:,} | {tokens:,} | {seconds / 60:.1f} min | {accuracy:.3f} | {rates} "
              f"| {served['mean_acceptance_length']:.3f} | {ceiling} |")


if __name__ == "__main__":
    main()
