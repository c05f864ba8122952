"""The half of bench/peer_speculators.py that runs with speculators 0.9.0 importable: started by it
with the project's venv python and PYTHONPATH=<speculators' side directory>:<repo>.

    convert RUN DATA --heldout-fraction F --val-samples N   a run's shards -> speculators' offline data
    tsl DATA OUT --epochs E --seed S (--target-steps N | --total-seq-len N)
                                                            the total_seq_len and its optimizer step count
    train INFO -- <speculators train flags>                 speculators' own trainer, on this CPU

speculators' offline data (speculators/train/data.py, ArrowDataset; hs_connectors' FileTransfer):
DATA is a `datasets.save_to_disk` table with a row per sample (input_ids, loss_mask, seq_len);
DATA/hidden_states/hs_{row}.safetensors holds token_ids [T] and hidden_states [T, 4, H]: the three
aux layers in order, then the target's last hidden state before its final norm (speculators
applies the target's norm and lm_head to it itself, and eaglenest's manifest says "pre_norm");
DATA/d2t-{N}.npy and t2d-{N}.npy are the run's own vocab maps. speculators splits train from val
by row index (train_data_ratio, strictly between 0 and 1), so the rows are every training sample
of eaglenest's split (not is_heldout), then up to N held-out samples as its val split, which it
only evaluates under no_grad: split.json records the ratio that puts the boundary after the last
training row.
"""

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch


def convert(run, data, heldout_fraction, val_samples):
    from safetensors.torch import save_file

    from eaglenest.data.samples import is_heldout
    from eaglenest.states.shards import ShardSamples

    manifest = json.loads((run / "hidden_states/manifest.json").read_text())
    if manifest["final_state"] != "pre_norm" or manifest["dtype"].startswith("float8"):
        sys.exit(f"{run}/hidden_states: speculators needs pre-norm final states in a float dtype "
                 f"(this run: {manifest['final_state']}, {manifest['dtype']})")
    shards = sorted(str(p) for p in (run / "hidden_states").glob("shard_*.safetensors"))
    train = ShardSamples(shards, keep=lambda i: not is_heldout(i, heldout_fraction))
    held = ShardSamples(shards, keep=lambda i: is_heldout(i, heldout_fraction))
    rows = [(train, i) for i in range(len(train))] + [(held, i) for i in range(min(val_samples, len(held)))]
    columns = {"id": [], "input_ids": [], "loss_mask": [], "seq_len": []}
    (data / "hidden_states").mkdir(parents=True, exist_ok=True)
    for row, (samples, i) in enumerate(rows):  # one sample in memory at a time
        sample, H = samples[i], manifest["hidden_size"]
        T = len(sample["input_ids"])
        states = torch.cat([sample["aux_hidden_states"].reshape(T, 3, H), sample["final_hidden_states"].reshape(T, 1, H)],
                           dim=1)
        save_file({"hidden_states": states.float().contiguous(), "token_ids": sample["input_ids"].long().contiguous()},
                  str(data / "hidden_states" / f"hs_{row}.safetensors"))
        for key, value in (("id", sample["id"]), ("input_ids", sample["input_ids"].tolist()),
                           ("loss_mask", sample["loss_mask"].long().tolist()), ("seq_len", T)):
            columns[key].append(value)

    import datasets
    import pyarrow as pa
    table = pa.table({"input_ids": pa.array(columns["input_ids"], type=pa.list_(pa.int64())),
                      "loss_mask": pa.array(columns["loss_mask"], type=pa.list_(pa.int64())),
                      "seq_len": pa.array(columns["seq_len"], type=pa.int64())})
    # A fingerprint of our own: datasets would otherwise hash the table with dill, which fails on
    # the venv's dill and this pyarrow (a PicklingError); the fingerprint only names the cache.
    fingerprint = hashlib.sha256(json.dumps(columns["id"]).encode()).hexdigest()[:16]
    dataset = datasets.Dataset(table, fingerprint=f"eaglenest-{fingerprint}")
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(data))

    d2t, t2d = torch.load(run / "vocab/d2t.pt"), torch.load(run / "vocab/t2d.pt")
    n = len(d2t)
    target_ids = d2t + torch.arange(n)
    # speculators takes its lm_head as the target's rows t2d selects, in ascending id order
    assert bool((target_ids[1:] > target_ids[:-1]).all()) and bool(t2d[target_ids].all()) and int(t2d.sum()) == n
    np.save(data / f"d2t-{n}.npy", d2t.numpy())
    np.save(data / f"t2d-{n}.npy", t2d.numpy())
    split = {"run": str(run), "train_samples": len(train), "val_samples": len(rows) - len(train),
             "train_data_ratio": (len(train) + 0.5) / len(rows), "draft_vocab_size": n,
             "aux_layer_ids": manifest["aux_layer_ids"], "heldout_fraction": heldout_fraction,
             "train_tokens": sum(columns["seq_len"][:len(train)])}
    assert int(len(rows) * split["train_data_ratio"]) == len(train)  # ArrowDataset's boundary
    (data / "split.json").write_text(json.dumps(split, indent=1) + "\n")
    print(f"converted {len(train)} training + {split['val_samples']} held-out val samples into {data}")


def optimizer_steps(lengths, total_seq_len, epochs, seed):
    """The optimizer steps speculators' trainer takes: a step per packed batch of its multipack
    sampler (one process: one replica), summed over its epochs 0 .. epochs-1."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths, num_replicas=1,
                                                 rank=0, seed=seed)
    steps = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        steps += len(sampler)
    return steps


def pick_total_seq_len(lengths, epochs, seed, target_steps):
    """The total_seq_len, no shorter than the longest sample (a longer sample would be cut), whose
    step count is nearest `target_steps` (ties: the shorter): a bisection for the first at or below
    it (the count falls with the length, though not strictly), then the 16 lengths either side."""
    steps = {}

    def count(tsl):
        if tsl not in steps:
            steps[tsl] = optimizer_steps(lengths, tsl, epochs, seed)
        return steps[tsl]

    lo, hi = max(lengths), sum(lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(mid) <= target_steps else (mid + 1, hi)
    best = min(range(max(max(lengths), lo - 16), lo + 17), key=lambda tsl: (abs(count(tsl) - target_steps), tsl))
    return best, count(best)


def tsl(data, out, epochs, seed, target_steps, total_seq_len):
    from speculators.train.data import ArrowDataset
    split = json.loads((data / "split.json").read_text())
    # the lengths its sampler packs: the train split as the trainer's ArrowDataset cuts it
    lengths = ArrowDataset(max_len=0, datapath=str(data), train_ratio=split["train_data_ratio"], split="train",
                           on_missing="raise").approx_lengths
    if total_seq_len is None:
        total_seq_len, steps = pick_total_seq_len(lengths, epochs, seed, target_steps)
    else:
        steps = optimizer_steps(lengths, total_seq_len, epochs, seed)
    out.write_text(json.dumps({"total_seq_len": total_seq_len, "steps": steps, "epochs": epochs, "seed": seed}) + "\n")


def train(info_path, argv):
    """speculators.train.cli.main on this CPU. Only where tensors live and the export's dtype
    change; the model, loss, optimizer, schedule, data and sampler are speculators' own."""
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    if torch.cuda.is_available():
        sys.exit("these patches put speculators on the CPU: on a GPU run its trainer as it is")
    # Its Trainer moves the model and every batch to get_local_rank(), 0: cuda:0 to torch.
    trainer.get_local_rank = lambda: "cpu"
    # Its step timer calls torch.accelerator.synchronize(), which raises without an accelerator;
    # CPU ops are synchronous, so doing nothing is exact.
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    # Its checkpoints are bfloat16 by default; eaglenest exports float32, and both drafters are
    # served at the same precision. The weights trained are float32 either way.
    save = checkpointer.SingleGPUCheckpointer.save_checkpoint
    checkpointer.SingleGPUCheckpointer.save_checkpoint = (
        lambda self, model, optimizer, epoch, float_dtype=None: save(self, model, optimizer, epoch, torch.float32))
    info = {}
    run_training = trainer.Trainer.run_training

    def counted(self):
        run_training(self)
        info["optimizer_steps"] = self.global_step
        info["trainable_params"] = sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    trainer.Trainer.run_training = counted
    start = time.time()
    config = TrainConfig.resolve(argv)
    main(config)
    # Its trainer catches SIGTERM and returns normally after saving "interrupted": only a run
    # that saved its last epoch is a finished one, and only that one leaves info_path.
    flat = config.flatten()
    last = Path(flat["save_path"]) / str(flat["epochs"] - 1)
    if not last.is_dir():
        sys.exit(f"speculators' training stopped before its last epoch ({last} is missing)")
    info |= {"wall_s": round(time.time() - start, 1), "torch_threads": torch.get_num_threads()}
    info_path.write_text(json.dumps(info, indent=1) + "\n")


def cli():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert")
    p.add_argument("run", type=Path)
    p.add_argument("data", type=Path)
    p.add_argument("--heldout-fraction", type=float, required=True)
    p.add_argument("--val-samples", type=int, default=64)
    p = sub.add_parser("tsl")
    p.add_argument("data", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--target-steps", type=int)
    how.add_argument("--total-seq-len", type=int)
    p = sub.add_parser("train")
    p.add_argument("info", type=Path)
    p.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.command == "convert":
        convert(args.run, args.data, args.heldout_fraction, args.val_samples)
    elif args.command == "tsl":
        tsl(args.data, args.out, args.epochs, args.seed, args.target_steps, args.total_seq_len)
    else:
        train(args.info, [flag for flag in args.flags if flag != "--"])


if __name__ == "__main__":
    cli()
