# Shared settings: config validation, result paths and code fingerprints.
import functools
import sys

from snakemake.exceptions import WorkflowError

# The workflow uses its own eaglenest/ (scripts reach it through the scripts/eaglenest link,
# Snakemake puts the scripts folder on their path): never an installed copy of another checkout.
sys.path.insert(0, workflow.basedir)

from eaglenest.workflow.config import HELDOUT_SUITE, check_suites, check_think_tokens, validate_config
from eaglenest.workflow.config import generation_temperatures
from eaglenest.workflow.serving import drafter_engines, fitted_temperature, method_temperatures
from eaglenest.workflow.fingerprint import code_fingerprint
from eaglenest.workflow.settings import artifact_settings
from eaglenest.workflow.parts import part_paths
from eaglenest.workflow.packages import package_file

try:
    validate_config(config, workflow.source_path("../schemas/config.schema.yaml"))
    check_suites(config)
    check_think_tokens(config)
    DRAFTER_ENGINES = drafter_engines(config)  # (draft method, K) of each drafter engine
except ValueError as e:
    raise WorkflowError(str(e))
if config["target"]["demo"] and "demo_target" not in config:
    raise WorkflowError("config: demo_target: required when target.demo is true")
if config["target"]["gguf"] and (config["target"]["demo"] or config["target"]["path"]):
    raise WorkflowError("config: target.gguf: builds the target: target.demo must be false and target.path null")
if not config["target"]["demo"] and not config["target"]["path"] and not config["target"]["gguf"]:
    raise WorkflowError("config: target.path: required when target.demo is false (or target.gguf)")
if (config["data"]["prompts"] is None) == (not config["data"].get("sources")):
    raise WorkflowError("config: data.prompts, data.sources: give one of them (prompts: a file in eaglenest's shape, "
                        "answered as it is; sources: datasets in their own shapes, read into prompts; the other null)")


RESULTS = config["results"]
BUILT_TARGET = config["target"]["demo"] or config["target"]["gguf"]  # built into {results}/target
TARGET = f"{RESULTS}/target" if BUILT_TARGET else config["target"]["path"]
RAW_RESPONSES = config["data"]["raw_responses"] or f"{RESULTS}/responses/raw_responses.jsonl"
# datasets read into PROMPTS by read_prompts (rules/generate.smk), unless responses come from elsewhere
SOURCES = [] if config["data"]["raw_responses"] else config["data"].get("sources") or []
PROMPT_COUNTS = f"{RESULTS}/prompts/sources.json"  # what read_prompts kept of each source, and why not the rest
PROMPTS = f"{RESULTS}/prompts/prompts.jsonl" if SOURCES else config["data"]["prompts"]  # what generation answers
TOKENIZED = f"{RESULTS}/data/tokenized_data.jsonl"
SHARD_IDS = [f"{i:05d}" for i in range(config["hidden_states"]["num_shards"])]
PARTS = f"{RESULTS}/data/shards"  # part_NNNNN.jsonl: the tokenized samples of a shard, .sha256: their digest
HIDDEN = f"{RESULTS}/hidden_states"
SHARD = f"{HIDDEN}/shard_{{shard}}.safetensors"
SHARDS = expand(SHARD, shard=SHARD_IDS)
MANIFEST = f"{HIDDEN}/manifest.json"
PLAN_JSON = f"{RESULTS}/plan.json"
D2T = f"{RESULTS}/vocab/d2t.pt"
T2D = f"{RESULTS}/vocab/t2d.pt"
DRAFTER = f"{RESULTS}/drafter"
# Evaluation in vLLM: the suites (the held-out split always, then eval.suites' files) and the
# draft method and K of each drafter engine
HELDOUT = HELDOUT_SUITE
SUITE_FILES = {suite["name"]: suite["prompts"] for suite in config["eval"]["suites"]}
SUITES = [HELDOUT, *SUITE_FILES]
SUITE_PATTERN = "|".join(SUITES)
SUITE_PROMPTS = expand(f"{RESULTS}/eval/prompts/{{suite}}.jsonl", suite=SUITES)
SPECULATIVE_TOKENS = sorted(set(config["eval"]["num_speculative_tokens"]))
SPECULATIVE_RUNS = [f"{RESULTS}/eval/vllm_speculative/{method}/K{k}.json" for method, k in DRAFTER_ENGINES]
# Snakemake's benchmark files of the GPU stages (wall time, peak RSS of each job): the report
# plots them, the plan turns an earlier run's into rates (eaglenest/plan)
BENCHMARKS = f"{RESULTS}/benchmarks"
ENV = "../envs/eaglenest.yaml"
# GPUs of a job extracting the target's states (hidden_states, agreement_states): with the vLLM
# backend the target's tensor-parallel ranks (the phase's engine service uses them while its
# jobs hold them: docs/HIDDEN_STATES.md "One target load per phase"); HF: one GPU on cuda; none on CPU
EXTRACTION_GPUS = (
    0
    if config["hidden_states"]["device"] == "cpu"
    else config["vllm"]["tensor_parallel_size"] if config["hidden_states"]["backend"] == "vllm" else 1
)


def code(script):
    """Fingerprint of scripts/<script>.py and the eaglenest modules it imports (a params entry)."""
    return code_fingerprint(workflow.basedir, f"scripts/{script}.py", ".snakemake/eaglenest/code_summaries.json")


@functools.cache
def split_folder(checkpoint):
    """The folder of a split checkpoint (shard_samples, split_prompts) once the split is complete:
    until then get() raises, which makes Snakemake re-decide the part jobs after the split; a
    raise is never cached. (Cached because 1,000 shards called get() 2,000 times per dry run.)"""
    return getattr(checkpoints, checkpoint).get().output.parts


def split_part(checkpoint, wildcard):
    """Input function of a job per part: its records and their digest, once `checkpoint` has run.
    Staleness comes from the digest, whose checksum Snakemake compares; the records file is ancient()."""

    def inputs(wildcards):
        part, digest = part_paths(split_folder(checkpoint), int(wildcards[wildcard]))
        return {"part": ancient(str(part)), "digest": str(digest)}

    return inputs


def suite_source(wildcards):
    """eval_prompts' input: the tokenized data for the held-out suite, else the suite's file and the target's tokenizer."""
    if wildcards.suite == HELDOUT:
        return {"tokenized": TOKENIZED}
    return {"prompts": SUITE_FILES[wildcards.suite], "target": TARGET}
