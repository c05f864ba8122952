# The demo target: a tiny Kimi-style model and tokenizer built deterministically from a seed
# (a Llama, or a DeepSeek-V3 packaged as Kimi-K2.5 ships: demo_target.architecture).

if config["target"]["demo"]:

    # demo_target.architecture: the script that builds it; num_kv_heads and head_dim are the Llama's alone
    DEMO_ARCHITECTURE = config["demo_target"]["architecture"]
    DEMO_SCRIPT = {"llama": "build_demo_target", "kimi_k25": "build_demo_kimi_target"}[DEMO_ARCHITECTURE]
    DEMO_UNUSED = ["corpus", "architecture"] + (["num_kv_heads", "head_dim"] if DEMO_ARCHITECTURE != "llama" else [])

    rule build_demo_target:
        input:
            corpus=config["demo_target"]["corpus"],
        output:
            target=directory(TARGET),
        params:
            settings={k: v for k, v in config["demo_target"].items() if k not in DEMO_UNUSED},
            code=code(DEMO_SCRIPT),
        log:
            f"{RESULTS}/logs/build_demo_target.log",
        threads: lambda wildcards: workflow.cores  # all cores; a callable, so that --unlock needs no --cores
        conda:
            ENV
        script:
            f"../scripts/{DEMO_SCRIPT}.py"


# A real pretrained target from a GGUF file that an installed package ships (target.gguf),
# dequantized to a plain float32 HF dir; the package is found without importing it.
if config["target"]["gguf"]:

    try:
        GGUF = package_file(config["target"]["gguf"]["package"], config["target"]["gguf"]["file"], "target.gguf")
    except ValueError as e:
        raise WorkflowError(str(e))

    rule build_gguf_target:
        input:
            gguf=GGUF,
        output:
            target=directory(TARGET),
        params:
            package=config["target"]["gguf"]["package"],
            sha256=config["target"]["gguf"]["sha256"],
            code=code("build_gguf_target"),
        log:
            f"{RESULTS}/logs/build_gguf_target.log",
        threads: lambda wildcards: workflow.cores  # all cores; a callable, so that --unlock needs no --cores
        conda:
            ENV
        script:
            "../scripts/build_gguf_target.py"
