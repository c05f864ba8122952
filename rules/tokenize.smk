# Faithful token streams: rendered prompt + exactly the tokens the target generated.


rule tokenize:
    input:
        raw=RAW_RESPONSES,
        target=TARGET,
    output:
        data=TOKENIZED,
        report=f"{RESULTS}/data/tokenize_report.json",
    params:
        trust_remote_code=config["target"]["trust_remote_code"],
        max_seq_len=config["tokenize"]["max_seq_len"],
        overlong=config["tokenize"]["overlong"],
        chat_template_kwargs=config["tokenize"]["chat_template_kwargs"],
        think_start=config["tokenize"]["think_start"],
        think_end=config["tokenize"]["think_end"],
        end_of_turn=config["tokenize"]["end_of_turn"],
        tool_call_tokens=config["tokenize"].get("tool_call_tokens"),
        code=code("tokenize"),
    log:
        f"{RESULTS}/logs/tokenize.log",
    conda:
        ENV
    script:
        "../scripts/tokenize.py"
