"""Config validation against schemas/config.schema.yaml, with one-line errors naming the key."""

import jsonschema
import yaml

HELDOUT_SUITE = "heldout"  # the evaluation suite of the training data's held-out split, always run


def validate_config(config, schema_path):
    """Raise ValueError("config: KEY: problem") for a replaced key (an older config) or the most
    relevant schema violation."""
    if isinstance(config.get("generate"), dict) and "temperature" in config["generate"]:
        raise ValueError("config: generate.temperature: replaced by generate.temperatures (a list; null: "
                         "eval.temperatures)")
    with open(schema_path) as f:
        schema = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml where built: every dry run reads it
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(config))
    if errors:
        error = jsonschema.exceptions.best_match(errors)
        key = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        raise ValueError(f"config: {key}: {error.message}")


def check_suites(config):
    """Raise ValueError unless eval.suites' names are distinct and leave HELDOUT_SUITE's to the held-out split."""
    names = [suite["name"] for suite in config["eval"]["suites"]]
    if HELDOUT_SUITE in names:
        raise ValueError(f"config: eval.suites: {HELDOUT_SUITE!r} is the training data's held-out split, always "
                         "evaluated: name the suite otherwise")
    if len(set(names)) < len(names):
        raise ValueError(f"config: eval.suites: names must be distinct, got {names}")


def check_think_tokens(config):
    """Raise ValueError unless tokenize.think_start and think_end are both set (a reasoning target) or both null."""
    start, end = config["tokenize"]["think_start"], config["tokenize"]["think_end"]
    if (start is None) != (end is None):
        raise ValueError(f"config: tokenize.think_start/think_end: both set (a reasoning target) or both null "
                         f"(a target without a reasoning block), got {start!r} and {end!r}")


def generation_temperatures(config):
    """The temperatures generate_part answers at: generate.temperatures, or when null those the
    drafter is served at (eval.temperatures), so that it learns the text it will be asked to draft."""
    temperatures = config["generate"]["temperatures"]
    return list(config["eval"]["temperatures"] if temperatures is None else temperatures)
