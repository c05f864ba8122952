"""The training memory model (eaglenest.train.memory) against the real code: the parameters and
the tensors autograd keeps, exactly, and the peak of a whole training micro-step, measured.

The measurement is bench/train_memory_model.py's, one fresh process per size (see its docstring):
the real pieces (a bf16 target on disk, TargetHead, new_drafter's drafter, AdamW), the loop's
micro-step (cast, ttt_loss, backward, clipping, AdamW.step) on CPU, its peak RSS above the RSS at a
reset made after everything the step only reads was built. CPU has no separate device memory,
so both sides leave out what the process held at the reset: the measurement starts from it, and
the model's figure is its peak minus those terms (memory.BETWEEN_STEPS, the collated batch and,
when accumulating, the gradients). Everything the step allocates is compared: the float32 casts
of the batch, the target's distribution and chunk logits, activations, logits, attention scores,
gradients, AdamW's transient. The sizes vary hidden size, vocabularies, tokens and samples, and
between them put the peak at different moments (the soft CE, an attention block's backward)
with float32 or bf16 autocast, checkpointing on or off, gradients fresh or accumulating.
"""

import dataclasses
import importlib.util

import pytest
import torch

from conftest import REPO, saved_storages
from eaglenest.drafter.model import Drafter, DrafterConfig, ttt_attend
from eaglenest.train.loss import soft_ce_loss
from eaglenest.train.memory import (autocast_weights, parameter_counts, retained_activations, static_memory,
                                    training_memory)
from eaglenest.train.optim import build_optimizers

spec = importlib.util.spec_from_file_location("train_memory_model", REPO / "bench" / "train_memory_model.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = DrafterConfig(target_vocab_size=200, draft_vocab_size=96, hidden_size=48, target_hidden_size=40,
                     intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                     aux_layer_ids=[1, 2, 3])
# docs/MEMORY.md: every size within 2.3% of its measurement. Measured (issue 46, 5 fresh processes per
# size of bench.TEST_SIZES, 2-core machine): ratios 1.0002-1.0009, 1.0060-1.0067, 0.9991-0.9994,
# 1.0212-1.0220, 1.0003-1.0015, 0.9990-0.9995; the largest miss 2.20%, a size's spread at most 0.12%.
# The bound: the doc's 2.3% plus twice that noise. The two mla sizes (issue 54, 3 fresh processes each):
# 1.0147-1.0156 and 0.9982-1.0006.
TOLERANCE = 0.025
# The recipe's options that change what training holds: the norm flags (the geometry), a frozen
# lm_head, the layer. The mla layer's v_head_dim differs from its q/k head (nope + rope), as
# Kimi's 128 from 192; with q_lora_rank (q_a_proj, q_a_layernorm, q_b_proj) and without (q_proj),
# with YaRN (the softmax factor on q) and without.
NORMED = dataclasses.replace(TINY, norm_before_fc=True, norm_output=True)
MLA = dataclasses.replace(TINY, layer="mla", num_key_value_heads=4, head_dim=8, q_lora_rank=32, kv_lora_rank=24,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
MLA_YARN = dataclasses.replace(MLA, q_lora_rank=None, norm_output=True, max_position_embeddings=256,
                               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                             "mscale": 1.0, "mscale_all_dim": 1.0})
RECIPES = {"plain": (TINY, True), "norms": (NORMED, True), "norms, frozen lm_head": (NORMED, False),
           "mla": (MLA, True), "mla without q_lora_rank, yarn, norm_output, frozen lm_head": (MLA_YARN, False)}


@pytest.mark.parametrize("config, train_lm_head", RECIPES.values(), ids=RECIPES)
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_parameters_and_static_terms_are_the_drafters(config, train_lm_head, optimizer):
    with torch.device("meta"):
        drafter = Drafter(config)
    drafter.lm_head.weight.requires_grad_(train_lm_head)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    linears = [m.weight for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
    assert parameter_counts(config, train_lm_head) == (sum(p.numel() for p in trainable),
                                                       sum(w.numel() for w in linears),
                                                       max(w.numel() for w in linears if w.requires_grad))
    static = static_memory(config, target_dtype_bytes=2, optimizer=optimizer, train_lm_head=train_lm_head)
    assert static["weights"] == static["gradients"] == sum(p.numel() * p.element_size() for p in trainable)
    assert static["frozen_embedding"] == drafter.embed_tokens.weight.numel() * 2  # bf16, as the target's
    assert static["vocab_maps"] == sum(b.numel() * b.element_size() for b in drafter.buffers())
    assert static_memory(config, target_dtype_bytes=2, tied_embeddings=True)["target_head"] == 2 * config.hidden_size
    drafter = Drafter(config)  # the optimizers' states, as their first step makes them
    drafter.lm_head.weight.requires_grad_(train_lm_head)
    for p in drafter.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    optimizers = build_optimizers(drafter, optimizer=optimizer, lr=1e-3, weight_decay=0.0, muon_lr=None,
                                  muon_weight_decay=0.1, warmup=0, total_steps=1, schedule="cosine")
    optimizers.step()
    states = [t for o in optimizers.optimizers for state in o.state.values() for t in state.values()]
    assert static["optimizer_states"] == sum(t.numel() * t.element_size() for t in states if t.numel() > 1)


def saved_bytes(drafter, samples, longest, autocast):
    """Bytes of the distinct storages autograd saves in Drafter.forward and soft_ce_loss (K = 3),
    leaving out the parameters and the tensors made before (aux states, target probs), seen by
    saved_tensors_hooks. Autocast's bf16 weight copies are saved tensors too."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY.target_vocab_size, (samples, longest), generator=g)
    aux = torch.randn(samples, longest, 3 * TINY.target_hidden_size, generator=g)
    probs = torch.randn(samples, longest, TINY.draft_vocab_size, generator=g).softmax(-1)
    mask = torch.ones(samples, longest, dtype=torch.bool)
    with saved_storages([aux, probs, *drafter.parameters()]) as seen:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = drafter(ids, aux, 3)
            soft_ce_loss(logits, probs, mask, mask, [1, 1, 1], 0.8)
    return sum(seen.values())


@pytest.mark.parametrize("config, train_lm_head", RECIPES.values(), ids=RECIPES)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast"])
def test_retained_activations_are_what_autograd_saves(checkpointing, autocast, config, train_lm_head):
    """Two samples of 8 tokens, so per-token and per-position terms differ. What the hooks do not
    see is the keys and values the TTT lists hold by reference ("kv"), which the model counts apart."""
    torch.manual_seed(0)
    drafter = Drafter(config)
    drafter.embed_tokens.weight = torch.nn.Parameter(torch.randn(200, 48, dtype=torch.bfloat16), requires_grad=False)
    drafter.lm_head.weight.requires_grad_(train_lm_head)
    drafter.activation_checkpointing = checkpointing
    model = retained_activations(config, tokens=16, longest=8, ttt_steps=3, autocast=autocast,
                                 checkpointing=checkpointing, cpu=True, train_lm_head=train_lm_head)
    _, kept, lm_head, _ = autocast_weights(config, 3, train_lm_head)
    copies = (lm_head if checkpointing else kept) if autocast else 0
    assert saved_bytes(drafter, 2, 8, autocast) == sum(model.values()) - model["kv"] + copies


@pytest.mark.parametrize("config, train_lm_head", RECIPES.values(), ids=RECIPES)
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast"])
def test_the_kv_term_is_the_storage_the_ttt_lists_hold(autocast, config, train_lm_head):
    """The "kv" group the hooks do not see: the distinct storages of one step's keys and values as
    ttt_attend stores them (mla: k made anew by the cat, v a view of kv_b_proj's whole output)."""
    drafter = Drafter(config)
    keys, values = [None], [None]
    ids, hidden = torch.zeros(2, 8, dtype=torch.long), torch.randn(2, 8, config.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        drafter.step(ids, hidden, torch.arange(8), ttt_attend(keys, values, 0))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (keys[0], values[0])}
    kv = retained_activations(config, tokens=16, longest=8, ttt_steps=1, autocast=autocast,
                              train_lm_head=train_lm_head)["kv"]
    assert sum(storages.values()) == kv


@pytest.mark.parametrize("size", bench.TEST_SIZES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_peak_of_a_training_step_is_within_2_5_percent_of_the_measured(size):
    measured = bench.run_measure(size)["bytes"]
    modelled, moment = bench.modelled_step(size)
    assert abs(measured / modelled - 1) <= TOLERANCE, (measured, modelled, moment)


def test_the_tv_backward_holds_no_more_than_the_soft_ces():
    """One TTT step's loss backward in float32, measured (bench.measure_loss_backward): two float32
    [positions, N] at its peak with the total variation term as without it, as at_backward_start
    and at_backward_tv say (autograd runs TotalVariation.backward before making the soft CE's
    gradient, then adds that into the TV's in place; the other way round would hold three)."""
    without, with_tv = bench.run_loss_backward()
    assert without == pytest.approx(2, abs=0.1) and with_tv == pytest.approx(2, abs=0.1)
    m = {tv_weight: training_memory(TINY, target_dtype_bytes=2, tokens=2048, longest=1024, ttt_steps=3,
                                    tv_weight=tv_weight) for tv_weight in (0.0, 1.0)}
    assert "at_backward_tv" not in m[0.0] and m[1.0]["at_backward_tv"] <= m[1.0]["at_backward_start"]
    assert m[0.0]["peak"] == m[1.0]["peak"]


@pytest.mark.parametrize("layer", ["gqa", "mla"])
def test_the_kimi_geometry_fits_a_budget_on_96_gb(layer):
    """The bench's reading for Kimi-K2.5 (bf16 target, draft vocab 32,000, K = 3, autocast), with
    either drafter layer: some budget fits one 96 GB GPU with the margin, and checkpointing lowers
    the peak."""
    config = bench.kimi_config(layer)
    assert config.layer == layer
    with torch.device("meta"):
        drafter = Drafter(config)
    assert parameter_counts(config)[0] == sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    peaks = {(ck, n): training_memory(config, target_dtype_bytes=2, tokens=n, longest=n, ttt_steps=3,
                                      activation_checkpointing=ck, autocast_bf16=True)["peak"]
             for ck in (False, True) for n in bench.KIMI_BUDGETS}
    assert all(peaks[True, n] < peaks[False, n] for n in bench.KIMI_BUDGETS)
    assert bench.largest_fitting(peaks, False) is not None


def test_muon_runs_at_lr_unless_set_and_adamw_takes_the_configured_betas():
    """train.muon_lr null: Muon at lr, as speculators 0.9.0 resolves it (its schema.py); the
    AdamW share (norms, lm_head) takes train.adamw_betas."""
    drafter = Drafter(TINY)
    for muon_lr, expected in ((None, 3e-3), (1e-2, 1e-2)):
        optimizers = build_optimizers(drafter, optimizer="muon", lr=3e-3, weight_decay=0.01, muon_lr=muon_lr,
                                      muon_weight_decay=0.1, warmup=0, total_steps=10, schedule="linear",
                                      adamw_betas=(0.9, 0.999))
        muon, adamw = optimizers.optimizers
        assert isinstance(muon, torch.optim.Muon) and muon.param_groups[0]["initial_lr"] == expected
        assert adamw.param_groups[0]["betas"] == (0.9, 0.999) and adamw.param_groups[0]["initial_lr"] == 3e-3
