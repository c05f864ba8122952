"""Code fingerprints for stale detection (stdlib only: the Snakefile imports this).

Snakemake tracks neither the modules a script imports nor anything below the script, so each
rule gets a `code` param: a hash of its script and of every eaglenest module the script reaches
through imports. The hash is of the syntax tree without docstrings, so comment, whitespace and
docstring edits do not make artifacts stale, while any change to what the code does does.
"""

import ast
import functools
import hashlib
from pathlib import Path

PACKAGE = "eaglenest"


def _tree(path):
    """The module's AST with docstrings removed."""
    tree = ast.parse(Path(path).read_text(), filename=str(path))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _imported_modules(tree):
    """Names of eaglenest modules imported anywhere in `tree` (also inside functions)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@functools.lru_cache(maxsize=None)
def _parsed(path, mtime_ns, size):
    """(docstring-free AST dump, eaglenest modules imported) of one file; parsed once per version
    (rules share most modules, and a dry run fingerprints every rule)."""
    tree = _tree(path)
    return ast.dump(tree), frozenset(_imported_modules(tree))


def _module(path):
    stat = Path(path).stat()
    return _parsed(Path(path), stat.st_mtime_ns, stat.st_size)


def module_closure(root, script):
    """Files of `script` and of every eaglenest module it reaches, sorted, relative to `root`."""
    root = Path(root)
    todo, seen = [Path(script)], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _module(root / path)[1]:
            candidate = Path(*name.split(".")).with_suffix(".py")
            if (root / candidate).is_file():
                todo.append(candidate)
    return sorted(seen)


def code_fingerprint(root, script):
    """sha256 over the docstring-free ASTs of `script` and its eaglenest import closure."""
    digest = hashlib.sha256()
    for path in module_closure(root, script):
        digest.update(str(path).encode() + b"\0" + _module(Path(root) / path)[0].encode() + b"\0")
    return digest.hexdigest()
