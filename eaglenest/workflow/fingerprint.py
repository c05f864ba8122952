"""Code fingerprints for stale detection (stdlib only: the Snakefile imports this).

Snakemake tracks neither the modules a script imports nor anything below the script, so each
rule gets a `code` param: a hash of its script and of every eaglenest module the script reaches
through imports (with the packages' __init__.py, which Python runs on the way). The hash is of
the syntax tree without docstrings and logging calls, so comment, whitespace, docstring and log
message edits do not make artifacts stale, while any change to what the code computes does.
Modules that cannot change an artifact's content (PLUMBING: logging and errors of a stage, GPU
leases, device choice, launching processes) are left out of every closure, with what only they
import.

Parsing every module slows every dry run (BENCHMARKS.md), so a module's summary is kept in a
cache file keyed by the sha256 of its source and of this file's: an entry can never be stale,
and a lost write only costs a parse.
"""

import ast
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

PACKAGE = "eaglenest"
# How a stage runs, not what it computes: a fix here rebuilds nothing (docs/REBUILDING.md).
PLUMBING = frozenset(map(Path, (
    "eaglenest/workflow/stage.py",      # logging to the rule's log, one-line errors
    "eaglenest/workflow/gpu_lease.py",  # which GPUs a job gets
    "eaglenest/workflow/device.py",     # cpu or cuda
    "eaglenest/train/launch.py",        # torchrun processes and nodes
    "eaglenest/engine/service.py",  # which process runs a phase's engine
    "eaglenest/workflow/tracking.py",   # live figures for TensorBoard, W&B, MLflow
)))
LOG_CALLS = frozenset(("debug", "info", "warning", "error", "exception", "critical"))
# Cache keys hold this file's own source too: a summary made by another version of summarize
# (e.g. before log calls were dropped) is never taken for one of this version.
_SUMMARIZER = Path(__file__).read_bytes()


def _is_log_call(node):
    """Whether `node` is a statement `log.info(...)` / `logging.warning(...)` (any logger named log,
    logger or logging): what it says is for people, not part of what the module computes."""
    call = node.value if isinstance(node, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in LOG_CALLS
            and isinstance(call.func.value, ast.Name) and call.func.value.id in ("log", "logger", "logging"))


def summarize(source):
    """(sha256 of the AST without docstrings and logging calls, sorted eaglenest modules imported
    anywhere) of a module."""
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not isinstance(body, list) or not body or not isinstance(body[0], ast.stmt):
                continue
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and field == "body" \
                    and isinstance(body[0].value.value, str):
                body = body[1:]
            kept = [statement for statement in body if not _is_log_call(statement)]
            setattr(node, field, kept or [ast.Pass()])
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest(), sorted(imported)


@functools.lru_cache(maxsize=None)
def _cache(cache_path):
    """The summaries stored at `cache_path` (read once per process; {} if absent or unreadable)."""
    try:
        return json.loads(Path(cache_path).read_text())
    except (OSError, ValueError):
        return {}


def _store(cache_path, summaries):
    """Replace the cache file atomically: concurrent runs may each write it, none sees a torn file."""
    Path(cache_path).parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=Path(cache_path).parent, prefix=".fingerprints.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(summaries, f)
    os.replace(tmp, cache_path)


@functools.lru_cache(maxsize=None)
def _module_files(root, name):
    """Files Python runs to import `name` (a module, or a name inside one): the __init__.py of
    each package on the way, then the module itself; () for names outside `root`. (Cached: the
    rules of one workflow import the same names, and each costs file-system lookups.)"""
    parts, files = name.split("."), []
    for i in range(1, len(parts) + 1):
        base = Path(*parts[:i])
        if (root / base / "__init__.py").is_file():
            files.append(base / "__init__.py")
        elif (root / base.with_suffix(".py")).is_file():
            files.append(base.with_suffix(".py"))
            break  # what follows names something inside the module
        else:
            break
    return tuple(files)


def _closure(root, script, summaries):
    """{path relative to `root`: summary} of `script` and every eaglenest module it reaches; new
    summaries are added to `summaries`, keyed by the sha256 of the summariser and the source."""
    root = Path(root)
    todo, found = [Path(script)], {}
    while todo:
        path = todo.pop()
        if path in found or path in PLUMBING:
            continue
        source = (root / path).read_bytes()
        key = hashlib.sha256(_SUMMARIZER + source).hexdigest()
        if key not in summaries:
            summaries[key] = summarize(source)
        found[path] = summaries[key]
        for name in found[path][1]:
            todo += _module_files(root, name)
    return found


def module_closure(root, script):
    """Files of `script` and of every eaglenest module it reaches, sorted, relative to `root`."""
    return sorted(_closure(root, script, {}))


def code_fingerprint(root, script, cache_path=None):
    """sha256 over the docstring-free ASTs of `script` and its eaglenest import closure; module
    summaries are cached in `cache_path` (a JSON file) when one is given."""
    summaries = _cache(cache_path) if cache_path else {}
    known = len(summaries)
    closure = _closure(root, script, summaries)
    if cache_path and len(summaries) > known:
        _store(cache_path, summaries)
    digest = hashlib.sha256()
    for path in sorted(closure):
        digest.update(f"{path}\0{closure[path][0]}\0".encode())
    return digest.hexdigest()
