# Token frequencies over generated tokens, then the draft vocabulary (d2t offsets, t2d mask).


rule token_freq:
    input:
        data=TOKENIZED,
        target=TARGET,
    output:
        freq=f"{RESULTS}/data/token_freq.pt",
    params:
        code=code("token_freq"),
    log:
        f"{RESULTS}/logs/token_freq.log",
    conda:
        ENV
    script:
        "../scripts/token_freq.py"


rule vocab_map:
    input:
        freq=rules.token_freq.output.freq,
    output:
        d2t=D2T,
        t2d=T2D,
        coverage=f"{RESULTS}/vocab/coverage.json",
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        code=code("vocab_map"),
    log:
        f"{RESULTS}/logs/vocab_map.log",
    conda:
        ENV
    script:
        "../scripts/vocab_map.py"
