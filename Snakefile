# eaglenest: prompts -> raw responses -> tokens -> draft vocab -> hidden states -> EAGLE-3 drafter -> evaluation.
# Thin on purpose: the logic lives in the eaglenest package, one script per rule calls it.

from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/generate.smk"
include: "rules/tokenize.smk"
include: "rules/vocab.smk"
include: "rules/hidden_states.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"


rule all:
    input:
        rules.summary.output,
        rules.export_eagle.output,
    default_target: True
