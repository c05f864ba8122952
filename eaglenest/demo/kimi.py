"""The Kimi-shaped demo target (config `demo_target.architecture: kimi_k25`): a tiny DeepSeek-V3
with Kimi's kind of tokenizer, pre-trained on the demo chats as the Llama demo target is, and
packaged as Kimi-K2.5 ships (docs/KIMI.md), so that every stage,
vLLM included, reads it through the wrapper the real target has.

The text model. MLA attention with the geometry vLLM's CPU MLA needs (kv_lora_rank 512,
qk_rope_head_dim 64), q compressed as in Kimi (q_lora_rank), MoE with a shared expert and the
first layer dense, `noaux_tc` routing with sigmoid scores and one group (as Kimi-K2.5), YaRN rope
scaling in Kimi's form, and 8 layers so that vLLM's default aux layers (2, 4, 5) are distinct.

The package. A `kimi_k25` config.json whose `text_config` holds the text model in Kimi's form
(model_type `kimi_k2`, `rope_scaling` with `type: yarn`, no `head_dim`), an `auto_map` naming
Kimi's remote model code (which is not shipped here: vLLM and transformers have their own
classes for it), and a `vision_config`. The weights carry the `language_model.` prefix, sit next
to a complete tiny vision tower and projector, and are split over two safetensors files with a
`model.safetensors.index.json`. The tokenizer is eaglenest.demo.kimi_tokenizer's.

What vLLM needs to load it as KimiK25ForConditionalGeneration (vllm/model_executor/models/
kimi_k25.py): vLLM reads the wrapper with transformers' Kimi_K25Config
(vllm/transformers_utils/config.py:103), whose Kimi_K25VisionConfig names the tower's dims
without the `vt_` prefix that Kimi's release uses. A vision_config with Kimi's keys alone gets
the tower of Kimi's own size (hidden 1152, 27 layers: Kimi_K25VisionConfig's defaults), and the
tiny tensors are refused. So the vision_config states each dim under both names, and the
checkpoint holds every tensor of the tower and the projector vLLM builds from them
(MoonViT3dPretrainedModel, KimiK25MultiModalProjector in kimi_k25_vit.py): vLLM's loader
requires every parameter to be loaded.

Only workflow plumbing and the Llama demo's training loop are imported from this package, so
editing a later stage never changes (or silently rebuilds) the target.
"""

import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

from eaglenest.demo.kimi_tokenizer import MEDIA_PAD, NAMED, RESERVED, chat_texts, write_kimi_tokenizer
from eaglenest.demo.target import _mean_loss, _pack, _train
from eaglenest.workflow.atomic import atomic_dir
from eaglenest.workflow.jsonl import read_objects

log = logging.getLogger(__name__)

# The tiny DeepSeek-V3 (also the tests' random one, tests/tiny_deepseek.py).
GEOMETRY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,           # the dense layers' MLP
    moe_intermediate_size=64,        # each expert's MLP
    num_hidden_layers=8,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=64,                  # Kimi-K2.5 and DeepSeek-V3 compress q too
    kv_lora_rank=512,                # what vLLM's CPU MLA needs
    qk_rope_head_dim=64,             # ditto
    qk_nope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,                       # as Kimi-K2.5
    topk_group=1,
    first_k_dense_replace=1,         # layer 0 dense, the others MoE
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_mtp_layers=0,                # no MTP weights to skip
    bos_token_id=None,
    eos_token_id=1,
    pad_token_id=None,
)
# Read by vLLM (getattr with other defaults), not fields of transformers' config class.
ROUTING = dict(topk_method="noaux_tc", scoring_func="sigmoid")

ROPE_THETA = 50000.0
YARN_ORIGINAL_POSITIONS = 128  # YaRN stretches these to max_position_embeddings
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=YARN_ORIGINAL_POSITIONS, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)  # Kimi-K2.5's form of rope_scaling (its figures are larger)

PREFIX = "language_model."
AUTO_MAP = {  # Kimi's remote model code, which nothing here runs: the files are not shipped
    "AutoConfig": "configuration_kimi_k25.KimiK25Config",
    "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
}
# Keys transformers derives from others and writes into config.json, which Kimi's text_config lacks.
DERIVED_KEYS = ("head_dim", "qk_head_dim", "transformers_version")

# The tiny vision tower (MoonViT) and projector; Kimi-K2.5's: hidden 1152, 27 layers, 16 heads, MLP 4304.
VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, patch_size=14,
              pos_emb=(4, 4, 4), merge_kernel_size=(2, 2))


def deepseek_config(**overrides):
    """The tiny DeepSeek-V3's transformers config, GEOMETRY with `overrides`, routed as Kimi's."""
    config = DeepseekV3Config(**{**GEOMETRY, **overrides})
    for key, value in ROUTING.items():
        setattr(config, key, value)
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config


def yarn(max_positions):
    """Kimi's rope_scaling for a model of `max_positions` positions."""
    return {**YARN, "factor": max_positions / YARN_ORIGINAL_POSITIONS}


def kimi_text_config(plain_config):
    """A plain DeepSeek-V3 config.json dict -> the same model as Kimi-K2.5's text_config."""
    text = {key: value for key, value in plain_config.items() if key not in DERIVED_KEYS}
    rope = dict(text.pop("rope_parameters"))
    text["rope_theta"] = rope.pop("rope_theta")
    rope.pop("rope_type")  # Kimi names the type "type"
    text["rope_scaling"] = rope
    text["torch_dtype"] = text.pop("dtype")
    text["model_type"] = "kimi_k2"
    return text


def vision_config(text_hidden_size):
    """The wrapper's vision_config: Kimi's keys (`vt_`-prefixed dims, `init_pos_emb_*`, the
    projector's), and each dim again under the name transformers' Kimi_K25VisionConfig, which
    vLLM reads, gives it (kimi_k25_vit.py, MoonViT3dPretrainedModel.__init__)."""
    v = VISION
    height, width, frames = v["pos_emb"]
    dims = {"hidden_size": v["hidden_size"], "num_hidden_layers": v["num_hidden_layers"],
            "num_attention_heads": v["num_attention_heads"], "intermediate_size": v["intermediate_size"]}
    return {
        "patch_size": v["patch_size"],
        "init_pos_emb_height": height, "init_pos_emb_width": width, "init_pos_emb_time": frames,
        "pos_emb_type": "divided_fixed",
        **{f"vt_{key}": value for key, value in dims.items()},
        "merge_kernel_size": list(v["merge_kernel_size"]),
        "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmerger", "mm_hidden_size": v["hidden_size"], "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5, "text_hidden_size": text_hidden_size,
        **dims,
    }


def vision_shapes(text_hidden_size):
    """{checkpoint name: shape} of the vision tower and projector vLLM builds from vision_config
    (kimi_k25_vit.py: MoonVision3dPatchEmbed, MoonViTEncoderLayer with biases, LayerNorms, the
    `patchmerger` KimiK25MultiModalProjector, whose linear_1/linear_2 Kimi's checkpoint names
    proj.0/proj.2)."""
    v = VISION
    hidden, mlp, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    height, width, _ = v["pos_emb"]
    merged = hidden * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]

    def norm(name, size):
        return {f"{name}.weight": (size,), f"{name}.bias": (size,)}

    def linear(name, out, into):
        return {f"{name}.weight": (out, into), f"{name}.bias": (out,)}

    shapes = {"vision_tower.patch_embed.proj.weight": (hidden, 3, patch, patch),
              "vision_tower.patch_embed.proj.bias": (hidden,),
              "vision_tower.patch_embed.pos_emb.weight": (height, width, hidden)}
    for i in range(v["num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}"
        shapes |= norm(f"{block}.norm0", hidden) | norm(f"{block}.norm1", hidden)
        shapes |= linear(f"{block}.wqkv", 3 * hidden, hidden) | linear(f"{block}.wo", hidden, hidden)
        shapes |= linear(f"{block}.mlp.fc0", mlp, hidden) | linear(f"{block}.mlp.fc1", hidden, mlp)
    shapes |= norm("vision_tower.encoder.final_layernorm", hidden) | norm("mm_projector.pre_norm", hidden)
    shapes |= linear("mm_projector.proj.0", merged, merged) | linear("mm_projector.proj.2", text_hidden_size, merged)
    return shapes


def vision_tensors(text_hidden_size, dtype, seed):
    """Random vision weights (never run: eaglenest's stages send text only), norms at identity."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in vision_shapes(text_hidden_size).items():
        is_norm = ".norm" in name or "layernorm" in name
        if is_norm:
            tensor = torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
        else:
            tensor = torch.randn(shape, generator=generator) * 0.02
        tensors[name] = tensor.to(dtype)
    return tensors


def write_sharded(tensors, out_dir, num_files=2):
    """`tensors` split over `num_files` safetensors files, with the index that names each one's file."""
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_files):
        file = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        part = names[i * len(names) // num_files:(i + 1) * len(names) // num_files]
        save_file({name: tensors[name] for name in part}, Path(out_dir) / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in part})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (Path(out_dir) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def package_as_kimi(plain_dir, out_dir, *, seed=0):
    """The plain DeepSeek-V3 checkpoint in `plain_dir` (save_pretrained's config.json and
    model.safetensors), written to `out_dir` as Kimi-K2.5 ships it; return its config.json dict.

    Kimi states its settings in both text_config and the wrapper: tie_word_embeddings and the
    dtype are copied up. The vision weights take the text weights' dtype. The media placeholder
    is <|media_pad|> of a Kimi-style vocabulary (base + 256 reserved ids), which vLLM's EAGLE
    proposer reads off a KimiK25ForConditionalGeneration target as `media_placeholder_token_id`
    (vllm/v1/spec_decode/llm_base_proposer.py:1382) and the model itself as `image_token_id`."""
    plain_config = json.loads((Path(plain_dir) / "config.json").read_text())
    weights = load_file(Path(plain_dir) / "model.safetensors")
    text_config = kimi_text_config(plain_config)
    dtype = weights["model.embed_tokens.weight"].dtype
    tensors = {PREFIX + name: tensor for name, tensor in weights.items()}
    tensors |= vision_tensors(text_config["hidden_size"], dtype, seed)
    write_sharded(tensors, out_dir)
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": AUTO_MAP,
        "torch_dtype": text_config["torch_dtype"],
        "tie_word_embeddings": text_config["tie_word_embeddings"],
        "bos_token_id": text_config["bos_token_id"],
        "eos_token_id": text_config["eos_token_id"],
        "media_placeholder_token_id": text_config["vocab_size"] - RESERVED + MEDIA_PAD,
        "image_token_id": text_config["vocab_size"] - RESERVED + MEDIA_PAD,
        "text_config": text_config,
        "vision_config": vision_config(text_config["hidden_size"]),
    }
    (Path(out_dir) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def build_demo_kimi_target(corpus_path, out_dir, *, seed=0, vocab_size=1024, num_layers=8, hidden_size=128,
                           intermediate_size=256, num_heads=2, seq_len=256, batch_size=8, steps=200, lr=5e-3):
    """Train the Kimi-style tokenizer and the tiny DeepSeek-V3 on `corpus_path` (canonical
    records), as eaglenest.demo.target.build_demo_target trains the Llama (same split, packing and
    training loop), and write them to `out_dir` packaged as Kimi-K2.5 ships, in bfloat16 as Kimi's
    weights are. vocab_size: the base vocabulary (256 bytes and the BPE merges) and the 256
    reserved special ids. Deterministic; `out_dir` appears only when the build succeeded. Returns
    the metadata also written to demo_target.json.
    """
    start = time.time()
    records = list(read_objects(corpus_path))
    heldout = max(1, len(records) // 20)
    train_records, heldout_records = records[:-heldout], records[-heldout:]
    max_positions = max(512, seq_len)
    merges = vocab_size - 256 - RESERVED
    if merges < 0:
        raise ValueError(f"demo_target.vocab_size {vocab_size}: a Kimi-style vocabulary holds 256 bytes and "
                         f"{RESERVED} reserved special ids at least")

    with atomic_dir(out_dir) as tmp:
        model_vocab = write_kimi_tokenizer(tmp, chat_texts(train_records), merges=merges,
                                           model_max_length=max_positions)
        tokenizer = AutoTokenizer.from_pretrained(tmp, trust_remote_code=True)
        train_rows = _pack(tokenizer, train_records, seq_len)
        heldout_rows = _pack(tokenizer, heldout_records, seq_len)
        log.info("tokenizer: %d ids; %d train rows, %d held-out rows of %d tokens",
                 model_vocab, len(train_rows), len(heldout_rows), seq_len)

        torch.manual_seed(seed)
        base = model_vocab - RESERVED
        special = {name: base + offset for offset, name in NAMED.items()}
        config = deepseek_config(
            vocab_size=model_vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
            max_position_embeddings=max_positions, rope_theta=ROPE_THETA, rope_scaling=yarn(max_positions),
            bos_token_id=special["[BOS]"], eos_token_id=special["[EOS]"])
        model = DeepseekV3ForCausalLM(config)
        heldout_init = _mean_loss(model, heldout_rows, batch_size)

        train_loss = _train(model, train_rows, seed=seed, batch_size=batch_size, steps=steps, lr=lr)
        meta = {
            "architecture": "kimi_k25", "seed": seed, "steps": steps, "vocab_size": model_vocab,
            "num_layers": num_layers, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
            "num_heads": num_heads, "seq_len": seq_len, "batch_size": batch_size, "lr": lr,
            "train_tokens": train_rows.numel(), "heldout_tokens": heldout_rows.numel(),
            "train_loss": train_loss,
            "heldout_loss_init": heldout_init,
            "heldout_loss": _mean_loss(model, heldout_rows, batch_size),
        }
        model.to(torch.bfloat16)
        meta["heldout_loss_bfloat16"] = _mean_loss(model, heldout_rows, batch_size)  # the weights as shipped
        with tempfile.TemporaryDirectory() as plain:
            model.save_pretrained(plain)
            package_as_kimi(plain, tmp, seed=seed)
        (tmp / "demo_target.json").write_text(json.dumps(meta, indent=2) + "\n")
    log.info("Kimi-shaped demo target in %s after %.0fs: train loss %.3f, held-out loss %.3f (%.3f at init, "
             "%.3f in bfloat16)", out_dir, time.time() - start, train_loss, meta["heldout_loss"], heldout_init,
             meta["heldout_loss_bfloat16"])
    return meta
