"""Code fingerprints: what a rule's script reaches, and which edits make its artifacts stale."""

import hashlib
import json
import shutil

from eaglenest.workflow.fingerprint import PLUMBING, code_fingerprint, module_closure

from conftest import REPO


def copy_repo(tmp_path):
    shutil.copytree(REPO / "eaglenest", tmp_path / "eaglenest", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "scripts", tmp_path / "scripts")
    return tmp_path


def test_closure_follows_eaglenest_imports_only():
    closure = [str(p) for p in module_closure(REPO, "scripts/tokenize.py")]
    assert closure == [
        "eaglenest/__init__.py",
        "eaglenest/data/__init__.py",
        "eaglenest/data/prompts.py",
        "eaglenest/data/records.py",
        "eaglenest/data/tokenize.py",
        "eaglenest/data/tokenizer.py",
        "eaglenest/workflow/__init__.py",
        "eaglenest/workflow/atomic.py",
        "eaglenest/workflow/errors.py",
        "eaglenest/workflow/jsonl.py",
        "scripts/tokenize.py",
    ]  # not stage.py nor gpu_lease.py: how a stage runs, not what it computes
    # generation renders prompts like tokenize but never reads response records
    assert "eaglenest/data/records.py" not in [str(p) for p in module_closure(REPO, "scripts/generate_part.py")]
    assert "eaglenest/data/tokenize.py" not in [str(p) for p in module_closure(REPO, "scripts/build_demo_target.py")]


def test_comments_whitespace_and_docstrings_do_not_count_but_code_does(tmp_path):
    root = copy_repo(tmp_path)
    module = root / "eaglenest" / "workflow" / "parts.py"  # hidden_states.py reaches it through states/parts.py
    before = code_fingerprint(root, "scripts/hidden_states.py")
    source = module.read_text()
    module.write_text(source.replace('"""Part index', '"""Part  index (typo fixed)').replace("\n\n\ndef ", "\n\n\n# note\n\ndef ") + "\n\n")
    assert code_fingerprint(root, "scripts/hidden_states.py") == before
    module.write_text(source.replace("% num_parts", "% (num_parts + 1)"))
    assert code_fingerprint(root, "scripts/hidden_states.py") != before
    assert code_fingerprint(root, "scripts/vocab_map.py") == code_fingerprint(REPO, "scripts/vocab_map.py")


def test_summary_cache_is_keyed_by_content_and_never_stale(tmp_path):
    """The cache the Snakefile passes: same fingerprints as without it, and an edit to a cached
    module still counts (its new source is a new key). A torn or foreign cache file is ignored."""
    root = copy_repo(tmp_path / "repo")
    cache = tmp_path / "cache" / "code_summaries.json"
    uncached = code_fingerprint(root, "scripts/hidden_states.py")
    assert code_fingerprint(root, "scripts/hidden_states.py", cache) == uncached
    stored = json.loads(cache.read_text())
    assert len(stored) == len(module_closure(root, "scripts/hidden_states.py"))
    module = root / "eaglenest" / "workflow" / "parts.py"
    module.write_text(module.read_text().replace("% num_parts", "% (num_parts + 1)"))
    edited = code_fingerprint(root, "scripts/hidden_states.py", cache)
    assert edited != uncached and edited == code_fingerprint(root, "scripts/hidden_states.py")
    assert len(json.loads(cache.read_text())) == len(stored) + 1
    # a cache written by another version of the summariser is not read as this one's
    foreign = tmp_path / "cache" / "foreign.json"
    foreign.write_text(json.dumps({hashlib.sha256(module.read_bytes()).hexdigest(): ["0" * 64, []]}))
    assert code_fingerprint(root, "scripts/hidden_states.py", foreign) == edited
    other = tmp_path / "cache" / "fresh.json"
    other.write_text('{"torn')
    assert code_fingerprint(root, "scripts/hidden_states.py", other) == edited


def test_log_messages_and_plumbing_do_not_count(tmp_path):
    """Editing what a stage logs, or how stages run (logging setup, GPU leases, device choice,
    launching), rebuilds nothing; what the code computes still counts."""
    root = copy_repo(tmp_path)
    before = {script: code_fingerprint(root, f"scripts/{script}.py") for script in ("train_drafter", "hidden_states")}
    loop = root / "eaglenest/train/loop.py"
    source = loop.read_text()
    assert 'log.info("' in source
    loop.write_text(source.replace('log.info("', 'log.info("(reworded) ', 1))
    for plumbing in PLUMBING:
        path = root / plumbing
        path.write_text(path.read_text() + "\n\ndef edited():\n    return 1\n")
    assert {script: code_fingerprint(root, f"scripts/{script}.py") for script in before} == before
    loop.write_text(source.replace('log.info("', 'print("', 1))  # no longer a log call: code
    assert code_fingerprint(root, "scripts/train_drafter.py") != before["train_drafter"]


def test_plumbing_imports_only_plumbing():
    """A module left out of the closures must not be the only way to reach code that computes."""
    from eaglenest.workflow.fingerprint import summarize

    allowed = {str(p.with_suffix("")).replace("/", ".") for p in PLUMBING} | {"eaglenest.workflow.errors"}
    for path in PLUMBING:
        imported = summarize((REPO / path).read_bytes())[1]
        modules = {name for name in imported if (REPO / (name.replace(".", "/") + ".py")).is_file()}
        assert modules <= allowed, (path, modules - allowed)
