"""Config validation against schemas/config.schema.yaml, with one-line errors naming the key."""

import jsonschema
import yaml


def validate_config(config, schema_path):
    """Raise ValueError("config: KEY: problem") for the most relevant schema violation."""
    with open(schema_path) as f:
        schema = yaml.safe_load(f)
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(config))
    if errors:
        error = jsonschema.exceptions.best_match(errors)
        key = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        raise ValueError(f"config: {key}: {error.message}")
