from eaglenest.evaluate.agreement_states import extract_agreement_states
from eaglenest.workflow.stage import run_stage

if __name__ == "__main__":  # the vLLM backend starts processes that may import this file again
    run_stage(
        snakemake.log[0],
        snakemake.threads,
        extract_agreement_states,
        snakemake.input.outputs,
        snakemake.input.manifest,
        snakemake.input.target,
        snakemake.output.states,
        backend=snakemake.params.backend,
        dtype=snakemake.params.dtype,
        device=snakemake.config["hidden_states"]["device"],
        batch_tokens=snakemake.config["hidden_states"]["batch_tokens"],
        vllm=snakemake.config["vllm"],
        trust_remote_code=snakemake.params.trust_remote_code,
        gpus=snakemake.resources.gpu,
    )
