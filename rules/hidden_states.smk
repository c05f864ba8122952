# Target hidden states, one job per shard; samples go to shards by a hash of their id.


rule hidden_states:
    input:
        data=TOKENIZED,
        target=TARGET,
    output:
        shard=f"{HIDDEN}/shard_{{shard}}.safetensors",
    wildcard_constraints:
        shard=r"\d{5}",
    params:
        shard=lambda wildcards: int(wildcards.shard),
        num_shards=config["hidden_states"]["num_shards"],
        aux_layer_ids=config["hidden_states"]["aux_layer_ids"],
        dtype=config["hidden_states"]["dtype"],
        device=config["hidden_states"]["device"],
        code=code("hidden_states"),
    log:
        f"{RESULTS}/logs/hidden_states/shard_{{shard}}.log",
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
