"""Benchmark: eaglenest's drafter against speculators 0.9.0's own trainer, same data, same vLLM judge.

From a finished run (results/: hidden_states, vocab, target, drafter, data/tokenized_data.jsonl,
train/train_log.tsv) this
1. installs speculators 0.9.0 and the few packages it needs that the venv lacks into a side
   directory ($PEER_SITE, default ~/.cache/eaglenest-peer/site), once, with pip --no-deps --target:
   never a project dependency, and only the processes that run speculators see it;
2. converts the run's shards into speculators' offline layout (bench/peer/speculators_cpu.py): its
   training samples (eaglenest's is_heldout split), then 64 held-out samples as speculators'
   mandatory val split, which it never trains on;
3. trains with speculators' trainer (speculators.train.cli.main) on the CPU, with the run's
   train.epochs, train.lr, train.ttt_steps, aux layers and draft vocab, and its own defaults for
   everything else (the recipe bench/recipe_ablation.py takes apart). Its optimizer steps are
   packed batches of its multipack sampler, total_seq_len tokens each: unless --total-seq-len is
   given, the script calls that sampler on the converted lengths and picks the total_seq_len whose
   step count is nearest the run's (train_log.tsv's last step; with --epochs, that share of it);
4. serves both drafters, the run's results/drafter and speculators' last epoch, through the one
   evaluation path the recipe ablation serves with (bench/vllm_judge.py: eaglenest's own vLLM
   functions, K = 3, 64 tokens, 8 requests at once, every held-out prompt of the run, seed 0):
   at temperature 0 drafting greedily, where speculation must leave the target's text unchanged,
   and above 0 with draft_sample_method "probabilistic";
5. writes WORK/summary.md, a table of optimizer steps, acceptance per position and mean
   acceptance length per trainer and temperature, and prints it.
Each step leaves its files in WORK (--work, default results/peer), and each vLLM engine runs in a
process of its own and leaves a JSON file, so an interrupted run resumes where it stopped. The
training directory is named by seed, epochs and total_seq_len, the evaluation one by --max-prompts.

On 2 otherwise idle cores, per the comparison this bench replaces: speculators' training about
2 min per 1,100 optimizer steps (today's demo run takes 2,196: some 4 min), then about 35 s per
vLLM engine (5: the target alone, then each drafter at each of 2 temperatures), about 7 min in
all; much longer when the cores are shared (the 1-epoch, 16-prompt smoke run in the last example
took 8.5 min beside another benchmark).

speculators 0.9.0 assumes a GPU. On the CPU it runs unchanged but for three patches (applied in
the training process only, speculators_cpu.py train):
- its Trainer puts the model and every batch on get_local_rank(), 0, which torch reads as cuda:0:
  rebound to return "cpu";
- its step timer calls torch.accelerator.synchronize(), which raises where there is no
  accelerator: a no-op, exact on the CPU, whose ops are synchronous;
- its checkpoints are saved in bfloat16 by default: saved in float32 instead, the precision of
  eaglenest's export, so that both drafters are served alike (the weights train in float32 either way).
and its own options where its default path is GPU-only:
- --draft-attn-impl sdpa: its default FlexAttention has no backward on the CPU (torch raises
  "FlexAttention does not support backward on CPU");
- --loss-implementation eager: its default "fused" loss is a Triton kernel;
- --hidden-states-dtype float32: it trains under torch.autocast("cuda", dtype) when torch finds no
  accelerator, which torch disables on a CPU-only machine, so float32 states train in float32, as
  eaglenest does on the CPU;
- --num-workers 0: its DataLoader workers would only compete for the 2 cores;
- --on-missing raise: every hidden state is on disk; it must never try to ask a vLLM server for one.
torch.compile it already skips without CUDA.

    .venv/bin/python bench/peer_speculators.py                                 # results/ -> results/peer/
    .venv/bin/python bench/peer_speculators.py --total-seq-len 574 --temperatures 0
    nice -n 19 .venv/bin/python bench/peer_speculators.py --work /tmp/peer_smoke --epochs 1 --max-prompts 16
"""

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from importlib.metadata import distributions
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from vllm_judge import CONCURRENCY, K, MAX_TOKENS, REPO, baseline, log_to, serve, suffix

# speculators and what it imports that the venv lacks (the rest, torch, transformers, pydantic,
# loguru..., the venv has at versions within its pins; torchvision and torchaudio, which it
# declares, the code paths used never import)
PEER_PACKAGES = ["speculators==0.9.0", "hs-connectors==0.9.0", "datasets==5.1.0", "pyarrow==24.0.0", "xxhash",
                 "multiprocess<0.70.20"]
SPECULATORS_SIDE = Path(__file__).resolve().parent / "peer/speculators_cpu.py"
VAL_SAMPLES = 64


def install(site):
    """PEER_PACKAGES into `site`, unless every one is there already at a version it allows."""
    have = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions(path=[str(site)])}
    wanted = {canonicalize_name(r.name): r.specifier for r in map(Requirement, PEER_PACKAGES)}
    if all(name in have and have[name] in versions for name, versions in wanted.items()):
        return
    print(f"installing {' '.join(PEER_PACKAGES)} into {site}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), *PEER_PACKAGES],
                   check=True)


def speculators_side(site, log, *args):
    """Run bench/peer/speculators_cpu.py with speculators importable, its output into `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, str(SPECULATORS_SIDE), *map(str, args)], stdout=f,
                              stderr=subprocess.STDOUT, env=os.environ | {"PYTHONPATH": f"{site}{os.pathsep}{REPO}"})
    if done.returncode:
        sys.exit(f"{SPECULATORS_SIDE.name} {args[0]} failed; the end of {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-30:]))


def train_speculators(args, config, site, project_steps):
    """Convert, pick total_seq_len and train (each unless done) -> (its export, its run info)."""
    train = config["train"]
    epochs = args.epochs or train["epochs"]
    data = args.work / "data"
    if not (data / "split.json").exists():
        speculators_side(site, args.work / "convert.log", "convert", args.run, data,
                         "--heldout-fraction", train["heldout_fraction"], "--val-samples", VAL_SAMPLES)
    split = json.loads((data / "split.json").read_text())
    target_steps = round(project_steps * epochs / train["epochs"])
    picked = args.work / f"tsl_s{args.seed}_e{epochs}_{args.total_seq_len or 'matched'}.json"
    if not picked.exists():
        speculators_side(site, args.work / "tsl.log", "tsl", data, picked, "--epochs", epochs, "--seed", args.seed,
                         *(["--target-steps", target_steps] if args.total_seq_len is None
                           else ["--total-seq-len", args.total_seq_len]))
    tsl = json.loads(picked.read_text())
    print(f"total_seq_len {tsl['total_seq_len']}: speculators' sampler packs {tsl['steps']} optimizer steps in "
          f"{epochs} epochs; eaglenest's run took {project_steps} in {train['epochs']}", file=sys.stderr, flush=True)
    root = args.work / f"speculators_s{args.seed}_e{epochs}_tsl{tsl['total_seq_len']}"
    if not (root / "info.json").exists():
        print(f"training with speculators' trainer into {root} (log: {root / 'train.log'})", file=sys.stderr,
              flush=True)
        for leftover in ("checkpoints", "logs"):  # of an interrupted training: start afresh
            shutil.rmtree(root / leftover, ignore_errors=True)
        speculators_side(
            site, root / "train.log", "train", root / "info.json", "--",
            "--verifier-name-or-path", args.run / "target", "--data-path", data, "--save-path", root / "checkpoints",
            "--log-dir", root / "logs", "--speculator-type", "eagle3", "--num-layers", 1,
            "--draft-vocab-size", split["draft_vocab_size"], "--target-layer-ids", *split["aux_layer_ids"],
            "--ttt-steps", train["ttt_steps"], "--epochs", epochs, "--lr", train["lr"],
            "--total-seq-len", tsl["total_seq_len"], "--train-data-ratio", split["train_data_ratio"],
            "--hidden-states-dtype", "float32", "--num-workers", 0, "--loss-implementation", "eager",
            "--draft-attn-impl", "sdpa", "--on-missing", "raise", "--seed", args.seed)
    info = json.loads((root / "info.json").read_text()) | {"total_seq_len": tsl["total_seq_len"],
                                                           "predicted_steps": tsl["steps"], "epochs": epochs}
    return root / "checkpoints" / str(epochs - 1), info


def eval_dir(args):
    return args.work / ("eval" if args.max_prompts is None else f"eval_p{args.max_prompts}")


def serve_one(args, config, key, drafter, temperature, method):
    """One vLLM engine (this process's only one): the target alone (key "baseline") at `temperature`,
    or `drafter` served on its prompts -> EVAL/<key><suffix>.json."""
    out = eval_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    served = suffix(temperature, method)
    log_to(out / f"log_{key}{served}.txt")
    # the target alone at the lowest temperature: at 0 the text speculation must leave unchanged
    # (above 0 vllm_speculative reads no text of it)
    prompts, outputs = baseline(config, min(args.temperatures), demo=args.run, out=out, max_prompts=args.max_prompts)
    if key != "baseline":
        result = serve(config, drafter, prompts, outputs, out / f"vllm_{key}{served}.json", temperature, method,
                       demo=args.run)
        (out / f"{key}{served}.json").write_text(json.dumps(result, indent=1) + "\n")


def summary(args, rows, info, project_steps, prompts):
    unchanged = ", ".join(f"{trainer} {'yes' if r['greedy_text_unchanged'] is True else 'NO'}"
                          + ("" if r["greedy_text_unchanged"] is True else f" ({r['divergent_share']:.0%} of prompts)")
                          for trainer, _, T, _, r in rows if T == 0)
    lines = [f"## eaglenest against speculators 0.9.0's trainer: {args.run}", "",
             f"vLLM, K={K}, {MAX_TOKENS} tokens, concurrency {CONCURRENCY}, {prompts} held-out prompts, seed 0"
             + (f"; greedy text unchanged at T=0: {unchanged}" if unchanged else "") + ".",
             f"speculators 0.9.0: seed {args.seed}, {info['epochs']} epochs (the run's: {args.config_epochs}), "
             f"total_seq_len {info['total_seq_len']}: {info['optimizer_steps']:,} optimizer steps "
             f"({info['predicted_steps']:,} by its sampler's count beforehand; eaglenest's run took "
             f"{project_steps:,} in {args.config_epochs} epochs), trained in {info['wall_s']:.0f} s on "
             f"{info['torch_threads']} threads.", "",
             "| trainer | optimizer steps | T | draft method | acceptance per position | mean acceptance length |",
             "|---|---|---|---|---|---|"]
    for trainer, steps, T, method, r in rows:
        rates = " / ".join(f"{a:.3f}" for a in r["acceptance_rate_per_position"])
        lines.append(f"| {trainer} | {steps:,} | {T:g} | {method} | {rates} | **{r['mean_acceptance_length']:.3f}** |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=REPO / "results", help="a finished run's results folder")
    parser.add_argument("--work", type=Path, default=REPO / "results/peer", help="where everything is written")
    parser.add_argument("--config", type=Path, default=REPO / "config.yaml", help="the run's config")
    parser.add_argument("--seed", type=int, default=42, help="speculators' --seed (its default)")
    parser.add_argument("--total-seq-len", type=int, help="speculators' tokens per step (default: matched steps)")
    parser.add_argument("--temperatures", default="0,1", type=lambda text: [float(t) for t in text.split(",")],
                        help="comma-separated; above 0: probabilistic drafting")
    parser.add_argument("--epochs", type=int, help="speculators' epochs (default: the run's train.epochs)")
    parser.add_argument("--max-prompts", type=int, help="held-out prompts served (default: all)")
    parser.add_argument("--serve", nargs=4, metavar=("KEY", "DRAFTER", "T", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.run, args.work = args.run.resolve(), args.work.resolve()
    config = yaml.safe_load(args.config.read_text())
    args.config_epochs = config["train"]["epochs"]
    if args.serve:
        key, drafter, temperature, method = args.serve
        return serve_one(args, config, key, Path(drafter), float(temperature), method)
    if not (args.run / "train/train_log.tsv").is_file() or not (args.run / "drafter").is_dir():
        sys.exit(f"{args.run} holds no finished run (train/train_log.tsv, drafter/): run `make demo` first")
    start = time.time()
    site = Path(os.environ.get("PEER_SITE") or Path.home() / ".cache/eaglenest-peer/site")
    install(site)
    project_steps = int(list(csv.DictReader(open(args.run / "train/train_log.tsv"), delimiter="\t"))[-1]["step"])
    export, info = train_speculators(args, config, site, project_steps)

    def engine(key, done, drafter=None, temperature=min(args.temperatures), method="greedy"):
        if not done.exists():
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--serve", key, str(drafter), str(temperature),
                            method], check=True)
            print(f"{key} T={temperature:g} {method} served", file=sys.stderr, flush=True)
        return done

    engine("baseline", eval_dir(args) / f"baseline_outputs{suffix(min(args.temperatures))}.jsonl")
    rows = []
    for trainer, key, drafter, steps in [("eaglenest", "eaglenest", args.run / "drafter", project_steps),
                                         ("speculators 0.9.0", export.parent.parent.name, export,
                                          info["optimizer_steps"])]:
        for T in args.temperatures:
            method = "greedy" if T == 0 else "probabilistic"
            done = engine(key, eval_dir(args) / f"{key}{suffix(T, method)}.json", drafter, T, method)
            rows.append((trainer, steps, T, method, json.loads(done.read_text())))
    table = summary(args, rows, info, project_steps, rows[0][4]["prompts"])
    (args.work / "summary.md").write_text(table)
    print(table)
    print(f"({time.time() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
