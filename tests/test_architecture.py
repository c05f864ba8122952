"""The house holds (docs/ARCHITECTURE.md): subpackages by stage with imports one way, no cycle, small
modules and functions, the three walls, and nothing cited from outside the repository."""

import ast
import re
import subprocess
import sys

import pytest

from conftest import REPO

PACKAGE = REPO / "eaglenest"
# Each subpackage may import its own modules and those of lower layers only; train and evaluate,
# on the same layer, never import each other.
LAYERS = {"workflow": 0, "engine": 1, "demo": 1, "data": 2, "states": 3, "drafter": 4, "train": 5, "evaluate": 5, "plan": 6,
          "report": 7}  # report reads every stage's artifacts; nothing imports it
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
LONG_REASON = "# Long:"  # a comment right above a longer function says why it is long
MODULES = sorted(PACKAGE.rglob("*.py"))


def module_name(path):
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imported_modules(path):
    """eaglenest modules that `path` imports anywhere (module level or inside functions)."""
    known = {module_name(p) for p in MODULES}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def layer(module):
    """The subpackage (or top-level module) of `module`, None for eaglenest/__init__.py."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_subpackage_has_a_layer():
    top = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.name != "__pycache__" and p.name != "__init__.py"}
    assert top == set(LAYERS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_run_one_way(path):
    own = layer(module_name(path))
    for other in imported_modules(path):
        theirs = layer(other)
        if own is None or theirs is None or theirs == own:
            continue
        assert LAYERS[theirs] < LAYERS[own], f"{module_name(path)} ({own}) imports {other} ({theirs})"


def test_no_import_cycle():
    graph = {module_name(p): imported_modules(p) - {module_name(p)} for p in MODULES}
    done, stack = set(), []

    def visit(module):
        if module in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(module):] + [module]))
        if module in done:
            return
        stack.append(module)
        for other in sorted(graph[module]):
            visit(other)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_modules_and_functions_stay_small(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= MAX_MODULE_LINES, f"{path.name}: {len(lines)} lines"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - first + 1
            if length > MAX_FUNCTION_LINES:
                assert lines[first - 2].strip().startswith(LONG_REASON), f"{path.name}: {node.name} has {length} lines"


def test_the_package_never_imports_snakemake():
    for path in MODULES:
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if n.split(".")[0] == "snakemake"], path


def test_the_workflow_never_imports_torch_transformers_or_vllm():
    """What the Snakefile and the rules import from eaglenest, imported alone, loads none of them."""
    sources = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
    imports = sorted({line.strip() for path in sources for line in path.read_text().splitlines()
                      if re.match(r"\s*(from|import) ", line)})
    assert any("eaglenest" in line for line in imports)
    heavy = ("torch", "transformers", "vllm", "safetensors")
    assert not [line for line in imports if any(re.search(rf"\b{h}\b", line) for h in heavy)]
    code = "\n".join(line for line in imports if "eaglenest" in line) + (
        f"\nimport sys\nloaded = sorted(m for m in {heavy!r} if m in sys.modules)\nassert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.parametrize("script", sorted((REPO / "scripts").glob("*.py")), ids=lambda p: p.name)
def test_scripts_only_unpack_and_call_one_function(script):
    """A script imports from eaglenest and makes one call, run_stage(..., fn, snakemake.*...),
    under `if __name__ == "__main__":` where the stage starts processes."""
    body = ast.parse(script.read_text()).body
    imports = [n for n in body if isinstance(n, ast.ImportFrom)]
    assert imports and all(n.module.startswith("eaglenest.") for n in imports)
    rest = [n for n in body if n not in imports]
    if len(rest) == 1 and isinstance(rest[0], ast.If):
        rest = rest[0].body
    assert len(rest) == 1 and isinstance(rest[0], ast.Expr) and isinstance(rest[0].value, ast.Call)
    call = rest[0].value
    assert call.func.id == "run_stage"
    for argument in [*call.args, *(k.value for k in call.keywords)]:
        for name in ast.walk(argument):
            if isinstance(name, ast.Name):
                assert name.id in {"snakemake", *(a.asname or a.name for n in imports for a in n.names)}, name.id


def test_vllm_engines_start_in_one_place():
    """Only eaglenest/engine/start.py imports vllm.LLM, so engine arguments come from one place."""
    for path in MODULES:
        if path == PACKAGE / "engine" / "start.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "vllm":
                assert "LLM" not in [a.name for a in node.names], path
            assert not (isinstance(node, ast.Attribute) and node.attr == "LLM"), path


def test_nothing_cites_a_file_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    outside = re.compile("REFERENCE" + r"\.md|/work/shared|\.\./shared")
    cited = [name for name in files if (REPO / name).is_file() and name != "tests/test_architecture.py"
             and outside.search((REPO / name).read_text(errors="ignore"))]
    assert not cited
