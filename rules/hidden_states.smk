# Target hidden states, one job per shard. Samples go to shards by a hash of their id; the
# shard_samples checkpoint splits the tokenized data per shard so that a shard is re-extracted
# only when its own samples change (see eaglenest/states/parts.py for how).


checkpoint shard_samples:
    input:
        data=TOKENIZED,
        engine_start=rules.engine_start_check.output.check,  # the drafter engines can start: before the hours of extraction
    output:
        parts=directory(PARTS),
    log:
        f"{RESULTS}/logs/shard_samples.log",
    params:
        num_shards=config["hidden_states"]["num_shards"],
        code=code("shard_samples"),
    conda:
        ENV
    script:
        "../scripts/shard_samples.py"


rule hidden_states:
    input:
        unpack(split_part("shard_samples", "shard")),
        target=TARGET,
    output:
        shard=SHARD,
    wildcard_constraints:
        shard=r"\d{5}",
    params:
        backend=config["hidden_states"]["backend"],
        aux_layer_ids=config["hidden_states"]["aux_layer_ids"],
        dtype=config["hidden_states"]["dtype"],
        # only the vLLM backend reads these: with HF, changing them must not re-extract anything;
        # devices, speed and placement are read from the config (docs/REBUILDING.md)
        vllm=artifact_settings(config, "vllm") if config["hidden_states"]["backend"] == "vllm" else None,
        trust_remote_code=config["target"]["trust_remote_code"],
        code=code("hidden_states"),
    benchmark:
        f"{BENCHMARKS}/hidden_states/shard_{{shard}}.tsv"
    log:
        f"{RESULTS}/logs/hidden_states/shard_{{shard}}.log",
    resources:
        gpu=EXTRACTION_GPUS,
    conda:
        ENV
    script:
        "../scripts/hidden_states.py"


rule hidden_states_manifest:
    input:
        shards=SHARDS,
        target=TARGET,
    output:
        manifest=MANIFEST,
    params:
        aux_layer_ids=config["hidden_states"]["aux_layer_ids"],
        dtype=config["hidden_states"]["dtype"],
        code=code("hidden_states_manifest"),
    log:
        f"{RESULTS}/logs/hidden_states_manifest.log",
    conda:
        ENV
    script:
        "../scripts/hidden_states_manifest.py"
