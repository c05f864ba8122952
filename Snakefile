# eaglenest: prompts -> raw responses -> tokens -> draft vocab -> hidden states -> EAGLE-3 drafter -> evaluation.
# Thin on purpose: the logic lives in the eaglenest package, one script per rule calls it.

from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


# The front page of `snakemake --report results/report.html` (make report): what each stage does
report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/engine_start.smk"
include: "rules/generate.smk"
include: "rules/tokenize.smk"
include: "rules/vocab.smk"
include: "rules/plan.smk"
include: "rules/hidden_states.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"


# Every artifact, not just the final ones: Snakemake rebuilds a missing intermediate only when
# something downstream of it is stale, so a shard removed as corrupt, or the outputs a failed job
# lost, would otherwise stay missing behind an up-to-date summary.
rule all:
    input:
        RAW_RESPONSES,
        rules.engine_start_check.output,
        rules.tokenize.output,
        rules.token_freq.output,
        rules.vocab_map.output,
        rules.plan.output,
        SHARDS,
        rules.hidden_states_manifest.output,
        rules.train_drafter.output,
        rules.export_eagle.output,
        rules.check_drafter.output,
        rules.evaluate_offline.output,
        SUITE_PROMPTS,
        rules.vllm_baseline.output,
        SPECULATIVE_RUNS,
        rules.agreement_states.output,
        rules.evaluate_vllm.output,
        rules.summary.output,
        rules.report_figures.output,
    default_target: True


# A GPU rule that the config runs on CPU (gpu 0: hidden_states.device cpu, train.device cpu) asks
# SLURM for no GPU model: the cluster profile's gpu_model and cpus_per_gpu (set for every such rule,
# as the profile cannot see the config) would make the plugin ask `--gpus=<model>:0`, and the job's
# srun is then refused (docs/CLUSTERS.md). Here, after the profile's set-resources are applied; a
# resource of None is left out of the jobs' resources (Snakemake's Rule.expand_resources).
for gpu_rule in workflow.rules:
    if gpu_rule.resources.get("gpu").value == 0:
        for name in ("gpu_model", "cpus_per_gpu"):
            gpu_rule.resources[name] = None
