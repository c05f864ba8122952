"""What the config says about serving, resolved for the rules (the Snakefile imports this; no stage
script does, so a change here rebuilds only what its resolved values reach through params): the
draft methods and K of the drafter engines, the temperatures each runs, the temperature training
fits at."""

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # vLLM's speculative_config.draft_sample_method values


def draft_sample_methods(config):
    """The draft methods evaluated (eval.draft_sample_methods), null resolved: greedy, and
    probabilistic too when a temperature above 0 is evaluated (at 0 vLLM drafts the argmax with
    either, so the two would be one run twice). Raises ValueError naming the key when a method
    would have nothing to run or a temperature no method."""
    methods = config["eval"]["draft_sample_methods"]
    temperatures = config["eval"]["temperatures"]
    sampled = any(t > 0 for t in temperatures)
    if methods is None:
        return ["greedy", "probabilistic"] if sampled else ["greedy"]
    if "probabilistic" in methods and not sampled:
        raise ValueError("config: eval.draft_sample_methods: probabilistic drafts only above temperature 0 (at 0 vLLM "
                         f"drafts the argmax), and eval.temperatures {temperatures} has none above 0")
    if 0 in temperatures and "greedy" not in methods:
        raise ValueError("config: eval.draft_sample_methods: temperature 0 (in eval.temperatures) is drafted greedily "
                         "by every method: include greedy")
    return [method for method in DRAFT_SAMPLE_METHODS if method in methods]


def drafter_engines(config):
    """(draft method, K) of every drafter engine: each of draft_sample_methods() at each K of
    eval.num_speculative_tokens."""
    Ks = sorted(set(config["eval"]["num_speculative_tokens"]))
    return [(method, K) for method in draft_sample_methods(config) for K in Ks]


def method_temperatures(method, temperatures):
    """The temperatures a drafter engine of draft method `method` runs: greedy every one,
    probabilistic those above 0 (at 0 it would repeat greedy's runs)."""
    return [t for t in temperatures if method == "greedy" or t > 0]


def fitted_temperature(config):
    """The temperature training fits the drafter at: train.temperature, or when null the largest
    served one above 0 (eval.temperatures), where probabilistic drafting accepts by the two
    distributions' overlap; 1.0 when every served one is 0, as greedy serving needs only the
    argmax, the same at any temperature. A float: the rule's params then hold 1 and 1.0 alike."""
    temperature = config["train"]["temperature"]
    if temperature is None:
        temperature = max((t for t in config["eval"]["temperatures"] if t > 0), default=1.0)
    return float(temperature)
