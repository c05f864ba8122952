"""The report (rules/report.smk, eaglenest/report): each figure and table on small real inputs, in
the artifacts' own formats, and `snakemake --report` on the built test workflow holding every
category, figure and caption. (tests/test_report_browser.py opens that report in a browser.)"""

import base64
import html
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from eaglenest.data.vocab import vocab_map
from eaglenest.evaluate.acceptance import acceptance, share_of_ceiling
from eaglenest.evaluate.online import recommend
from eaglenest.evaluate.summary import counts_in_words, greedy_identity
from eaglenest.plan.plan import sample_counts
from eaglenest.report.common import percent
from eaglenest.report.data import (coverage_curve, coverage_table, plot_coverage, plot_sample_lengths,
                                   sample_lengths, write_coverage_table)
from eaglenest.report.evaluate import plot_acceptance, plot_speed, write_acceptance_table
from eaglenest.report.plan import write_plan_table
from eaglenest.report.stages import stages_table
from eaglenest.report.states import plot_shards, shard_rows
from eaglenest.report.train import plot_training
from eaglenest.train.loop import log_columns, write_tsv
from eaglenest.workflow.atomic import save_torch, write_json

# What rules/report.smk puts in the report: {category: the files under results/report/}
CATEGORIES = {
    "Plan": {"plan.html"},
    "Data": {"sample_lengths.svg", "vocab_coverage.svg", "vocab_coverage.html"},
    "Hidden states": {"shards.svg"},
    "Training": {"training.svg"},
    "Evaluation": {"acceptance.svg", "acceptance.html", "speed.svg"},
    "Stages": {"stages.html"},
}
BENCHMARK_HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def text_of(path_or_text):
    """What a person reads in an SVG (text stays text: svg.fonttype none) or an HTML page: the
    text between the tags, entities decoded, whitespace collapsed."""
    text = Path(path_or_text).read_text() if isinstance(path_or_text, Path) else path_or_text
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())


def zipf_counts(vocab, total=10**6):
    """int64 [vocab]: Zipf-like counts of each generated id, as token_freq.pt holds them."""
    return (total / torch.arange(1, vocab + 1, dtype=torch.float64)).long()


def test_the_coverage_curve_is_what_vocab_map_keeps(tmp_path):
    counts = torch.tensor([5, 0, 9, 9, 1, 3, 0, 2] * 40, dtype=torch.int64)  # ties and unseen ids
    save_torch(tmp_path / "freq.pt", counts)
    for size in (1, 7, 50, 320):
        coverage = vocab_map(tmp_path / "freq.pt", tmp_path / "d2t.pt", tmp_path / "t2d.pt", tmp_path / "cov.json",
                             draft_vocab_size=size)
        assert coverage_curve(counts.numpy())[size - 1] == pytest.approx(coverage["coverage"])
    curve = coverage_curve(counts.numpy())
    assert (curve[1:] >= curve[:-1]).all() and curve[-1] == pytest.approx(1.0)


def test_the_coverage_table_caps_at_the_target_vocab_and_marks_the_chosen_size(tmp_path):
    counts = zipf_counts(20_000)
    curve = coverage_curve(counts.numpy())
    table = coverage_table(counts.numpy(), 12_000).set_index("draft vocab size")
    assert list(table.index) == ["8,192 (8K)", "12,000", "16,384 (16K)", "32,768 (32K)", "65,536 (64K)"]
    assert table.loc["8,192 (8K)", "generated tokens covered"] == percent(curve[8191])
    assert table.loc["16,384 (16K)", "ids kept"] == "16,384" and table.loc["32,768 (32K)", "ids kept"] == "20,000"
    assert table.loc["12,000", "note"] == "chosen (vocab.draft_vocab_size)"
    assert "capped" in table.loc["65,536 (64K)", "note"] and not table.loc["16,384 (16K)", "note"]
    assert table.loc["65,536 (64K)", "generated tokens covered"] == "100.00%"
    save_torch(tmp_path / "freq.pt", counts)
    write_coverage_table(tmp_path / "freq.pt", tmp_path / "coverage.html", draft_vocab_size=12_000)
    page = text_of(tmp_path / "coverage.html")
    assert f"8,192 (8K) 8,192 41.0% {percent(curve[8191])}" in page
    assert "chosen (vocab.draft_vocab_size)" in page and "capped: the target has 20,000 ids" in page
    assert f"Out of {int(counts.sum()):,} generated tokens (20,000 distinct ids" in page


@pytest.mark.parametrize("vocab", [512, 20_000])
def test_the_coverage_plot_marks_the_sizes_that_fit_and_the_chosen_one(tmp_path, vocab):
    counts = zipf_counts(vocab)
    counts[vocab // 2:] = 0  # half the vocabulary never generated
    save_torch(tmp_path / "freq.pt", counts)
    plot_coverage(tmp_path / "freq.pt", tmp_path / "coverage.svg", draft_vocab_size=128)
    text = text_of(tmp_path / "coverage.svg")
    curve = coverage_curve(counts.numpy())
    assert "draft vocabulary size N (ids, log scale)" in text and "generated tokens covered (%)" in text
    assert f"chosen: 128 ids, {100 * curve[127]:.1f}%" in text and f"target vocabulary: {vocab:,} ids" in text
    if vocab == 512:  # the demo's: every common size is past the whole vocabulary
        assert "8K, 16K, 32K, 64K: at least the whole target vocabulary (512 ids): 100%" in text
    else:
        assert f"8K: {100 * curve[8191]:.1f}%" in text and f"16K: {100 * curve[16383]:.1f}%" in text
        assert "32K, 64K: at least the whole target vocabulary (20,000 ids): 100%" in text
    assert f"{vocab // 2:,} distinct ids were generated" in text


def test_the_sample_lengths_histogram_marks_max_seq_len_and_the_truncated(tmp_path):
    lengths = [5, 9, 12, 20, 20, 33, 40, 64, 64]
    with open(tmp_path / "tokenized.jsonl", "w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"id": str(i), "input_ids": [1] * n, "loss_mask": [0] * 3 + [1] * (n - 3)}) + "\n")
    report = {"samples_in": 12, "samples_out": 9, "tokens": sum(lengths), "generated_tokens": sum(lengths) - 27,
              "truncated": 2, "rejected": {"no_generated_tokens": 3}}
    write_json(tmp_path / "report.json", report)
    _, _, counted = sample_counts(tmp_path / "tokenized.jsonl", 1, 0.0)  # the plan reads the samples, the report the plan
    write_json(tmp_path / "plan.json", {"sample_lengths": counted})
    assert [list(a) for a in sample_lengths(tmp_path / "plan.json")] == [lengths, [n - 3 for n in lengths]]
    plot_sample_lengths(tmp_path / "plan.json", tmp_path / "report.json", tmp_path / "lengths.svg",
                        max_seq_len=64, overlong="truncate")
    text = text_of(tmp_path / "lengths.svg")
    for expected in ["Sample lengths after tokenization", "length (tokens)", "samples", "tokenize.max_seq_len = 64",
                     "12 records in, 9 samples kept", "2 truncated to 64 tokens (tokenize.overlong: truncate)",
                     "0 dropped as too long", "3 dropped with no generated token", "generated tokens (loss_mask = 1)"]:
        assert expected in text, expected


def test_the_shards_plot_gives_tokens_and_the_rate_of_each_shard(tmp_path):
    shards = [{"file": f"shard_{i:05d}.safetensors", "sample_ids": [str(j) for j in range(i + 2)],
               "num_tokens": 1000 * (i + 1), "content_sha256": "0" * 64} for i in range(3)]
    write_json(tmp_path / "manifest.json", {"shards": shards, "aux_layer_ids": [2, 4, 5]})
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    for i, seconds in [(0, 2.0), (2, 4.0)]:  # shard 1 has no benchmark file
        (bench / f"shard_{i:05d}.tsv").write_text(BENCHMARK_HEADER + f"{seconds}\t0:00:0{int(seconds)}\t512.5\t1\t1\t1\t0\t0\t50\t1\n")
    assert shard_rows(tmp_path / "manifest.json", bench) == [("00000", 2, 1000, 2.0), ("00001", 3, 2000, None),
                                                             ("00002", 4, 3000, 4.0)]
    plot_shards(tmp_path / "manifest.json", bench, tmp_path / "shards.svg")
    text = text_of(tmp_path / "shards.svg")
    for expected in ["3 shards, 6,000 tokens", "Tokens per shard", "mean 2,000", "Extraction rate per shard (1 without a benchmark)",
                     "tokens / s (job wall time)", "mean 625 tokens/s", "00000 00001 00002", "shard"]:
        assert expected in text, expected


def write_train_log(path, *, heldout=False):
    """A train_log.tsv as training writes it (3 TTT steps, 2 epochs); heldout: with held-out
    columns measured every 20 steps."""
    columns = log_columns(3)
    rows = [[step, (step - 1) // 50, 1e-3, 3.0 - step / 100, *[2.0 - step / 100 + k / 10 for k in range(3)],
             *[0.3 + step / 200 - k / 20 for k in range(3)], *[0.5 + step / 250 - k / 20 for k in range(3)], 0.4, 200 * step,
             step / 10.0] for step in range(10, 101, 10)]
    if heldout:
        columns = columns + ["heldout_loss_0", "heldout_acc_0"]
        rows = [row + ([1.9 - row[0] / 100, 0.35 + row[0] / 200] if row[0] % 20 == 0 else ["", ""]) for row in rows]
    write_tsv(path, columns, rows)


@pytest.mark.parametrize("heldout", [False, True])
def test_the_training_plot_has_loss_and_accuracy_per_ttt_step(tmp_path, heldout):
    write_train_log(tmp_path / "train_log.tsv", heldout=heldout)
    plot_training(tmp_path / "train_log.tsv", tmp_path / "training.svg")
    text = text_of(tmp_path / "training.svg")
    for expected in ["Drafter training: 100 optimizer steps, 2 epochs", "Loss per TTT step", "Accuracy per TTT step",
                     "optimizer step", "cross-entropy against the target (nats / token)",
                     "top-1 agreement with the target (share)", "TTT step 1, training", "TTT step 3, training",
                     "epoch start"]:
        assert expected in text, expected
    assert ("TTT step 1, held out" in text) == heldout and "TTT step 2, held out" not in text


CEILINGS = {"greedy": "argmax oracle", "probabilistic": "draft-vocab oracle"}


def vllm_run(suite, temperature, method, K, concurrency, speedup):
    """One run of vllm_metrics.json (eaglenest.evaluate.agreement.speculative_run's fields), from
    the accepted lengths of vLLM's drafts and of the offline replay on the same text; probabilistic
    drafting accepts a little more, below a higher ceiling."""
    if temperature == 0:
        lengths, replayed, ceiling = [3, 3, 2, 1, 0, 3, 3, 3], [3, 3, 2, 1, 0, 3, 2, 3], [1.0] * K
    elif method == "greedy":
        lengths, replayed, ceiling = [1, 0, 0, 2, 0, 1, 0, 0], [1, 0, 1, 2, 0, 1, 0, 0], [0.6, 0.4, 0.25][:K]
    else:
        lengths, replayed, ceiling = [1, 1, 0, 2, 0, 1, 0, 3], [1, 1, 1, 2, 0, 1, 0, 3], [0.8, 0.6, 0.45][:K]
    online, offline = acceptance([min(a, K) for a in lengths], K), acceptance([min(a, K) for a in replayed], K)
    errors = [0.0 if temperature == 0 else 0.05] * K
    offline |= {"indicator_rate_per_position": offline["acceptance_rate_per_position"],
                "standard_error_per_position": errors}
    tolerance = [0.2] * K if temperature == 0 else [3.5 * e for e in errors]
    gaps = [abs(a - b) for a, b in zip(online["acceptance_rate_per_position"], offline["acceptance_rate_per_position"])]
    run = {"suite": suite, "temperature": temperature, "draft_sample_method": method, "num_speculative_tokens": K,
           "concurrency": concurrency, "prompts": 4, "generated_tokens": 60, "counters": {}, **online,
           "tokens_per_s_without_speculation": 400.0 * concurrency,
           "tokens_per_s_with_speculation": 400.0 * concurrency * speedup, "speedup": speedup,
           "vllm_same_text": online, "offline": offline,
           "ceiling": CEILINGS[method], "ceiling_per_position": ceiling,
           "share_of_ceiling_per_position": share_of_ceiling(online["acceptance_rate_per_position"], ceiling),
           "max_disagreement": max(gaps), "tolerance_per_position": tolerance,
           "agrees": all(g <= t for g, t in zip(gaps, tolerance))}
    if temperature == 0:
        run |= {"greedy_text_unchanged": True, "divergent_share": 0.0, "divergences": []}
    return run


def write_metrics(root):
    """offline_metrics.json and vllm_metrics.json in their formats (docs/CONTRACTS.md): two suites,
    two temperatures (greedy drafting at 0, greedy and probabilistic at 1), K 1 and 3, concurrency 1
    and 4; speculation pays held out (probabilistic drafting more, at 1), not on chat."""
    served = acceptance([3, 3, 2, 1, 0, 3, 2, 3], 3)
    served |= {"ceiling_per_position": [1.0, 1.0, 0.875],
               "share_of_ceiling_per_position": share_of_ceiling(served["acceptance_rate_per_position"], [1.0, 1.0, 0.875])}
    offline = {"num_speculative_tokens": 3, **acceptance([3, 3, 2, 1, 0, 3, 2, 3, 1, 2], 3), "served": served,
               "heldout_samples": 4, "heldout_tokens": 120, "heldout_generated_tokens": 60}
    base = {("heldout", 0.0): 1.2, ("heldout", 1.0): 0.9, ("chat", 0.0): 0.6, ("chat", 1.0): 0.5}
    runs = [vllm_run(suite, t, method, K, c,
                     round(base[suite, t] + 0.1 * K - 0.2 * (c == 4) + 0.15 * (method == "probabilistic"), 6))
            for (suite, t) in base for method in (["greedy"] if t == 0 else CEILINGS) for K in (1, 3) for c in (1, 4)]
    vllm = {"vllm_version": "0.0-test", "max_tokens": 16, "suites": {"chat": 3, "heldout": 4},
            "temperatures": [0.0, 1.0], "num_speculative_tokens": [1, 3], "concurrency": [1, 4],
            "draft_sample_methods": list(CEILINGS),
            "ceilings": {"greedy": "argmax oracle: an oracle drafting the target's own argmax, accepted with max p_T",
                         "probabilistic": "draft-vocab oracle: an oracle drafting from p_T restricted to the draft "
                                          "vocabulary, accepted with p_T's mass on the draft vocabulary"},
            "engine_dtype": "float32",
            "agreement": {"greedy_tolerance": 0.2, "standard_errors": 3, "sampled_comparisons": 16, "z": 3.5},
            "runs": runs, "recommended": recommend(runs)}
    write_json(root / "offline.json", offline)
    write_json(root / "vllm.json", vllm)
    return offline, vllm


def test_the_acceptance_plot_puts_vllm_and_offline_side_by_side_per_suite_temperature_and_method(tmp_path):
    offline, vllm = write_metrics(tmp_path)
    plot_acceptance(tmp_path / "offline.json", tmp_path / "vllm.json", tmp_path / "acceptance.svg")
    text = text_of(tmp_path / "acceptance.svg")
    for expected in ["Acceptance per position at K = 3, vLLM 0.0-test and offline (at most 16 tokens per prompt)",
                     "heldout, temperature 0 (4 prompts) greedy drafting, ceiling: argmax oracle",
                     "heldout, temperature 1 (4 prompts) greedy drafting, ceiling: argmax oracle",
                     "heldout, temperature 1 (4 prompts) probabilistic drafting, ceiling: draft-vocab oracle",
                     "chat, temperature 0 (3 prompts) greedy drafting",
                     "chat, temperature 1 (3 prompts) greedy drafting",
                     "chat, temperature 1 (3 prompts) probabilistic drafting",
                     "position 1 position 2 position 3", "share of drafts accepted through k",
                     "vLLM, 1 request at once", "vLLM, 4 requests at once", "offline, on the baseline's text",
                     "offline, held-out shards, at vLLM's anchors", "± 3 standard errors of the offline-vLLM gap",
                     "ceiling, greedy drafting: argmax oracle", "ceiling, probabilistic drafting: draft-vocab oracle"]:
        assert expected in text, expected
    assert "temperature 0 (4 prompts) probabilistic" not in text  # at 0 the methods are one: greedy alone ran
    assert text.index("heldout, temperature 0") < text.index("chat, temperature 0")  # the held-out split first
    for temperature, method in [(0, "greedy"), (1, "probabilistic")]:
        largest = next(r for r in vllm["runs"] if (r["num_speculative_tokens"], r["temperature"],
                                                   r["draft_sample_method"]) == (3, temperature, method))
        for figures in (largest, largest["offline"]) + (offline["served"],) * (temperature == 0):
            for rate in figures["acceptance_rate_per_position"]:
                assert f"{rate:.2f}" in text


def test_the_speed_plot_gives_the_speedup_against_k_and_the_method_and_k_to_serve_with(tmp_path):
    write_metrics(tmp_path)
    plot_speed(tmp_path / "offline.json", tmp_path / "vllm.json", tmp_path / "speed.svg")
    text = text_of(tmp_path / "speed.svg")
    for expected in ["Speed-up against K, vLLM 0.0-test (tokens/s with the drafter / without)",
                     "K (num_speculative_tokens: tokens drafted per step)", "speed-up (x)",
                     "1x: speculation does not pay below", "1 request at once", "4 requests at once",
                     "greedy drafting: solid line, filled markers", "probabilistic drafting: dashed line, open markers",
                     "recommended draft method and K: the best measured speed-up (in the title)",
                     "heldout, temperature 0 (4 prompts) 1 at once: greedy K=3, 1.50x 4 at once: greedy K=3, 1.30x",
                     # greedy alone would not pay at 4 at once (1.00x): probabilistic drafting does
                     "heldout, temperature 1 (4 prompts) 1 at once: probabilistic K=3, 1.35x "
                     "4 at once: probabilistic K=3, 1.15x",
                     "chat, temperature 1 (3 prompts) 1 at once: does not pay (probabilistic K=3: 0.95x)"]:
        assert expected in text, expected


def test_the_acceptance_table_has_every_run_and_the_method_and_k_to_serve_with(tmp_path):
    offline, vllm = write_metrics(tmp_path)
    write_acceptance_table(tmp_path / "offline.json", tmp_path / "vllm.json", tmp_path / "acceptance.html")
    page = text_of(tmp_path / "acceptance.html")
    run = next(r for r in vllm["runs"] if (r["suite"], r["temperature"], r["num_speculative_tokens"],
                                            r["concurrency"]) == ("heldout", 0.0, 3, 1))
    rates, replayed = (" / ".join(f"{r:.3f}" for r in f["acceptance_rate_per_position"]) for f in (run, run["offline"]))
    assert (f"heldout 0 greedy 3 1 8 {rates} {run['mean_acceptance_length']:.2f} 1.000 / 1.000 / 1.000 "
            f"0.88 / 0.75 / 0.62 {rates} {replayed} 0.200 / 0.200 / 0.200 {run['max_disagreement']:.3f} yes unchanged "
            "400 600 1.50x") in page
    # sampled: z standard errors; a method's runs beside the other's, each under its own ceiling
    assert "chat 1 greedy 1 4 8 0.375 1.38 0.600 0.62 0.375 0.500 0.175 0.125 yes — 1,600 640 0.40x" in page
    assert "chat 1 probabilistic 1 4 8 0.625 1.62 0.800 0.78 0.625 0.750 0.175 0.125 yes — 1,600 880 0.55x" in page
    assert "heldout 0 1 greedy, K = 3 1.50x" in page and "heldout 1 4 probabilistic, K = 3 1.15x" in page
    assert "chat 1 1 no drafter: does not pay (best: probabilistic, K = 3) 0.95x" in page
    assert "Offline and vLLM agree in 24 of 24 runs" in page and "suites heldout (4 prompts), chat (3 prompts)" in page
    assert "a draft at every anchor" in page and f"{offline['served']['mean_acceptance_length']:.2f}" in page
    # the ceiling of each run's method beside acceptance: every run, what to serve with, the held-out shards
    assert "K concurrency drafts" in page and "ceiling (of the method) share of ceiling" in page
    for method, ceiling in vllm["ceilings"].items():
        assert f"{method.capitalize()} drafting's ceiling, {ceiling}." in page
    assert "Greedy's ceiling bounds greedy drafting only" in page
    assert ("heldout 1 1 probabilistic, K = 3 1.35x 2.00 0.625 / 0.250 / 0.125 0.800 / 0.600 / 0.450 "
            "0.78 / 0.42 / 0.28") in page
    assert "ceiling (argmax oracle), at its own anchors 1.000 1.000 0.875 3.88 — —" in page


def test_near_ties_where_speculation_changed_greedy_text_are_reported(tmp_path):
    """Where evaluate_vllm judged a greedy divergence a near-tie of the target's logits (numerics:
    eaglenest/evaluate/greedy_identity.py), the summary's agreement line and the report's runs
    table say so; unchanged text reads as before."""
    _, vllm = write_metrics(tmp_path)
    assert greedy_identity(vllm) == "; greedy text unchanged by speculation"
    run = next(r for r in vllm["runs"] if (r["suite"], r["temperature"], r["num_speculative_tokens"],
                                            r["concurrency"]) == ("heldout", 0.0, 3, 1))
    run |= {"greedy_text_unchanged": False, "divergent_share": 0.25, "divergences": [
        {"id": "p1", "generated_token": 30, "baseline_token": 5, "speculative_token": 9, "margin": 0.0625,
         "tolerance": 0.15625, "near_tie": True}]}
    vllm["engine_dtype"] = "bfloat16"
    assert greedy_identity(vllm) == ("; greedy text changed by speculation at 1 prompt(s) in 1 run(s), each at a "
                                     "near-tie of the target's logits within bfloat16 rounding (closest to the "
                                     "limit: margin 0.0625 of tolerance 0.156)")
    run |= {"replayed_text_differs": {"p1": 30}, "vllm_same_text": run["vllm_same_text"] | {"num_drafts": 5}}
    assert greedy_identity(vllm).endswith("; where a text left the replayed one, the 1 run(s) were compared on the "
                                          f"drafts made before (5 of {run['num_drafts']})")
    write_json(tmp_path / "vllm.json", vllm)
    write_acceptance_table(tmp_path / "offline.json", tmp_path / "vllm.json", tmp_path / "acceptance.html")
    assert "25% of prompts changed, each at a near-tie of the target's logits" in text_of(tmp_path / "acceptance.html")


def test_the_plan_table_gives_sizes_and_the_time_per_stage(tmp_path):
    plan = {"samples": 2000, "tokens": 107_073, "generated_tokens": 52_964, "truncated_samples": 3,
            "hidden_states_bytes": 10**9, "free_disk_bytes": 50 * 10**9, "extraction_host_ram_bytes": 3 * 10**6,
            "training_gpu_memory_bytes": 17_401_730, "shards": [{"samples": 1, "tokens": 2, "bytes": 3}],
            "training_memory": {"device": "cpu", "processes": 1, "bf16_autocast": False, "micro_batch_tokens": 256,
                                "terms": {"weights": 10**6, "activations": 3 * 10**6, "peak": 17_401_730}},
            "stages": [
                {"stage": "generate", "work": 52_964, "unit": "generated tokens", "rate": 645.8,
                 "rate_source": "this run's benchmark files", "estimate_s": 82.0, "measured": True},
                {"stage": "hidden_states", "work": 107_073, "unit": "tokens", "rate": 3395.6,
                 "rate_source": "earlier run in this results folder", "estimate_s": 31.5},
                {"stage": "train_drafter", "work": 383_496, "unit": "supervised tokens", "rate": None,
                 "rate_source": None, "estimate_s": None}]}
    write_json(tmp_path / "plan.json", plan)
    write_plan_table(tmp_path / "plan.json", tmp_path / "plan.html")
    page = text_of(tmp_path / "plan.html")
    for expected in ["samples 2,000", "tokens 107,073", "truncated samples 3", "hidden states on disk 1.00 GB",
                     "free disk there 50.00 GB", "host RAM per extraction job 3.0 MB",
                     "training memory per process (peak) 17.4 MB", "training runs on cpu, 1 process(es)",
                     "generate 52,964 generated tokens 646 generated tokens/s this run's benchmark files 0:01:22 (measured)",
                     "hidden_states 107,073 tokens 3,396 tokens/s earlier run in this results folder 31.5 s (estimate)",
                     "train_drafter 383,496 supervised tokens — no rate yet", "total 1 stage(s) without an estimate 0:01:54",
                     "activations 3.0 MB weights 1.0 MB"]:
        assert expected in page, expected


def embedded(report_html):
    """The report's embedded data: (results {path: record}, categories {category: {subcategory:
    [paths]}}, workflow description HTML), as Snakemake's template writes them into the page."""
    page = Path(report_html).read_text()

    def var(script_id, name):  # <script id="results">var results = {...};</script>
        return json.loads(re.search(rf'<script id="{script_id}">\s*var {name} = (.*?);\s*</script>', page, re.S)[1])

    return var("results", "results"), var("categories", "categories"), var("workflow-desc", "workflow_desc")


def test_the_report_holds_every_category_figure_and_caption(report_html, built):
    results, categories, description = embedded(report_html)
    found = {category: {Path(path).name for paths in subcategories.values() for path in paths}
             for category, subcategories in categories.items()}
    assert found == CATEGORIES
    assert {s: sorted(Path(p).name for p in paths) for s, paths in categories["Data"].items()} == {
        "Samples": ["sample_lengths.svg"], "Draft vocabulary": ["vocab_coverage.html", "vocab_coverage.svg"]}
    for path, result in results.items():
        name = Path(path).name
        assert path == f"results/report/{name}" and result["job_properties"]["rule"] == "report_figures"
        assert list(result["labels"]) == ["figure"] and result["labels"]["figure"]  # one label: no toggles
        caption = text_of(result["caption"])
        assert len(caption) > 200 and "System Message" not in result["caption"], (name, caption)
        mime = "image/svg+xml" if name.endswith(".svg") else "text/html"
        assert result["mime_type"] == mime and result["data_uri"].startswith(f"data:{mime}")
        content = base64.b64decode(result["data_uri"].split("base64,", 1)[1]).decode()
        assert content == (built / path).read_text(), name  # the very file, embedded
    # captions and the front page are rendered with this run's config (the built workflow's: conftest FAST)
    assert "vocab.draft_vocab_size = 128" in text_of(results["results/report/vocab_coverage.svg"]["caption"])
    text = text_of(description)
    assert "System Message" not in description
    assert "eaglenest: an EAGLE-3 drafter" in text and "in 3 shards" in text and "samples longer than 512 tokens" in text
    assert "vllm_speculative" in text and "vllm_runs" not in text and "at each K of 3 " in text
    for category in CATEGORIES:
        for name in CATEGORIES[category] - {"vocab_coverage.html", "acceptance.html"}:  # linked from the front page
            assert f"showResultInfo('results/report/{name}')" in description, name
    assert "the training data's held-out split)" in text and "at most 16 prompts of each (64 tokens per prompt)" in text
    for where, words in [("front page", text), ("summary.md", (built / "results/summary.md").read_text()),
                         *((name, text_of(result["caption"])) for name, result in results.items())]:
        assert not PYTHON.findall(words), (where, PYTHON.findall(words))


# What Python prints and a person does not write: a dict, None, True, False, a list of quoted strings
PYTHON = re.compile(r"\{'|\bNone\b|\bTrue\b|\bFalse\b|\[\s*['\"]")


@pytest.mark.parametrize("edit", ["as_is", "sources_and_limits"])
def test_the_captions_and_the_front_page_put_config_values_in_words(edit):
    """Every report/*.rst rendered as `snakemake --report` renders it (Jinja with trim_blocks and
    lstrip_blocks, then docutils) with the config's nulls and lists, and with data.sources,
    eval.max_prompts and eval.draft_sample_methods set: well-formed text without Python in it."""
    import jinja2
    import yaml
    from docutils.core import publish_parts

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    if edit == "sources_and_limits":
        config["data"] |= {"prompts": None, "sources": [{"path": "a.jsonl", "weight": 1}, {"path": "b.parquet"}]}
        config["eval"] |= {"max_prompts": 5, "draft_sample_methods": ["greedy", "probabilistic"]}
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    pages = {}
    for path in (REPO / "report").glob("*.rst"):
        text = env.from_string(path.read_text()).render(snakemake=SimpleNamespace(config=config))
        links = "\n" + "".join(f"\n.. _{name}: #\n" for name in set(re.findall(r"(?<!`)`([^`]+)`_", text)))  # Snakemake's, to results
        rendered = publish_parts(text + links, writer_name="html")["html_body"]
        assert "System Message" not in rendered, path.name
        pages[path.name] = text_of(rendered)
        assert not PYTHON.findall(pages[path.name]), (path.name, PYTHON.findall(pages[path.name]))
    front = pages["workflow.rst"]
    if edit == "as_is":
        assert "the prompts of resources/demo/prompts.jsonl in vLLM, in 4 parts" in front
        assert ("chat ( resources/demo/eval_chat.jsonl ), tools ( resources/demo/eval_tools.jsonl ), every prompt of "
                "each (48 tokens per prompt)") in front
        assert "(unset: greedy, and probabilistic above temperature 0)" in front
    else:
        assert "the prompts of the 2 datasets of data.sources , mixed ( read_prompts ) in vLLM" in front
        assert "at most 5 prompts of each (48 tokens per prompt)" in front and "(greedy and probabilistic)" in front


def test_the_summary_puts_counts_in_words():
    assert counts_in_words({"too_long": 3, "no_generated_tokens": 0, "duplicate": 1024}) == "3 too long, 1,024 duplicate"
    assert counts_in_words({}) == "none"


def test_the_built_runs_figures_carry_its_numbers(built):
    results = built / "results"
    tokenize = json.loads((results / "data/tokenize_report.json").read_text())
    coverage = json.loads((results / "vocab/coverage.json").read_text())
    online = json.loads((results / "eval/vllm_metrics.json").read_text())
    stages = text_of(results / "report/stages.html")
    with_drafter = [f"vLLM with the drafter, {method}, K = {k}" for method in online["draft_sample_methods"]
                    for k in online["num_speculative_tokens"]]
    for stage in ("target", "generate", "tokenize", "draft vocabulary", "plan", "hidden states", "train",
                  "offline evaluation", "evaluation prompts", "vLLM baseline", *with_drafter, "agreement states",
                  "vLLM evaluation"):
        assert f" {stage} " in stages, stage
    assert f"{tokenize['samples_out']:,} samples, {tokenize['tokens']:,} tokens" in stages
    assert "3 shards" in stages and "pre-flight check passed" in stages
    coverage_page = text_of(results / "report/vocab_coverage.html")
    assert f"{coverage['draft_vocab_size']} {coverage['draft_vocab_size']} " in coverage_page
    assert percent(coverage["coverage"]) in coverage_page
    speed, table = text_of(results / "report/speed.svg"), text_of(results / "report/acceptance.html")
    for best in online["recommended"]:  # the method and K to serve with, in the speed plot's titles and in the table
        method, K, x = best["draft_sample_method"], best["num_speculative_tokens"], f"{best['speedup']:.2f}x"
        assert (f"{best['concurrency']} at once: {method} K={K}, {x}" if best["speculation_pays"]
                else f"{best['concurrency']} at once: does not pay ({method} K={K}: {x})") in speed
        assert (f"{best['suite']} {best['temperature']:g} {best['concurrency']} "
                + (f"{method}, K = {K}" if best["speculation_pays"]
                   else f"no drafter: does not pay (best: {method}, K = {K})")) in table
    assert f"agree in {len(online['runs'])} of {len(online['runs'])} runs" in stages
    frame = stages_table({key: results / path for key, path in {
        "plan": "plan.json", "tokenize": "data/tokenize_report.json", "coverage": "vocab/coverage.json",
        "manifest": "hidden_states/manifest.json", "train_log": "train/train_log.tsv", "check": "eval/drafter_check.json",
        "offline": "eval/offline_metrics.json", "vllm": "eval/vllm_metrics.json", "agreement": "eval/agreement_states",
    }.items()}, results / "benchmarks", generated_here=True, target_source="demo").set_index("stage")
    assert frame.loc["hidden states", "jobs benchmarked"] == "3" and frame.loc["generate", "jobs benchmarked"] == "4"
    assert frame.loc["tokenize", "wall time"] == "—" and frame.loc["train", "wall time"] != "—"
    for stage in ("vLLM baseline", *with_drafter, "agreement states", "vLLM evaluation"):
        assert frame.loc[stage, "jobs benchmarked"] == "1" and frame.loc[stage, "wall time"] != "—", stage
