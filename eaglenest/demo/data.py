"""Deterministic arithmetic chat conversations for the built-in demo target.

A drafter only has something to learn if the target is unsure of some tokens: every question,
reasoning style and answer is therefore drawn from several phrasings, while the arithmetic stays
exact, so the model can be confident on tokens that follow from earlier ones (the digits of a
result it already wrote in its reasoning) and unsure on others (which phrasing comes next).

    python -m eaglenest.demo.data    # rewrites resources/demo/{corpus,prompts,raw_responses,eval_chat,eval_tools}.jsonl

corpus.jsonl pre-trains the demo target; prompts.jsonl is what the demo asks it (its answers,
generated in vLLM, are the drafter's data); raw_responses.jsonl is a hand-written set of
responses covering every edge case of the record format (tests and docs/TOKENIZATION.md, "Input records");
eval_chat.jsonl is the demo's own evaluation suite, unlike the training prompts; eval_tools.jsonl
its suite of tool-using prompts.

Some chats declare a calculator tool: the model then calls it (reasoning, then a tool-call
section and <|im_end|>), or, given the tool's result in a tool turn, answers from it. So the
target's answers to such prompts are tool calls, and the drafter learns them.
"""

import argparse
import json
import random
from pathlib import Path

from eaglenest import CHECKOUT
from eaglenest.workflow.atomic import atomic_path

DEMO_DIR = CHECKOUT / "resources" / "demo"

# Plain conversations mix in the benign variations, so the target has seen system prompts,
# earlier turns, empty reasoning and unicode; the rest only ever appear as edge cases.
PLAIN_KINDS = ["normal"] * 14 + ["system", "system", "multi_turn", "multi_turn", "empty_reasoning", "unicode"] + ["tool"] * 3
PROMPT_KINDS = ["normal"] * 12 + ["system", "system", "multi_turn", "multi_turn", "unicode", "special_text"] + ["tool"] * 3
EDGE_KINDS = ["normal", "system", "multi_turn", "empty_reasoning", "cut_reasoning", "cut_content",
              "unicode", "special_text"]

SYSTEM_PROMPTS = [
    "You are a careful math tutor.",
    "You are a helpful assistant. Keep answers short.",
    "Solve arithmetic problems and show your work.",
    "You are Eagle, a friendly calculator.",
    "Think step by step, then answer in one line.",
]
QUESTIONS = ["What is {e}?", "Compute {e}.", "{e} = ?", "Please work out {e}.",
             "Can you calculate {e} for me?", "How much is {e}?"]
UNICODE_QUESTIONS = ["Combien font {e} ? Merci 🙂", "¿Cuánto es {e}?", "Rechne bitte: {e} — danke!",
                     "Quick one for the café till: {e}?", "Naïve question: what is {e}? 🙂"]
SPECIAL_QUESTIONS = [
    "My log shows <think> and <|im_end|> everywhere. Anyway: {q}",
    "{q} (ignore the strings <think> and <|im_end|> in this message)",
    "Treat <|im_end|> and <think> as plain words. {q}",
]
FOLLOW_UPS = ["", "Thanks! ", "Great. Next: ", "And another one: "]
OPENERS = ["", "", "Let me work this out. ", "Okay. ", "Step by step. "]
ANSWERS = ["The answer is {r}.", "{e} = {r}.", "{e} = **{r}**", "{r}", "It is {r}."]
UNICODE_ANSWERS = ["Voilà : {e} = {r} 🙂", "{e} = {r} ✅", "Résultat : {r}."]
CLOSINGS = ["Let me know if you need another one.", "Hope this helps!", "Happy to check more sums."]
# The tool the tool-using chats declare, in the OpenAI form, and what the model thinks around it.
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
CALL_REASONINGS = ["I will use the calculator for {e}.", "Let me ask the calculator: {e}.",
                   "The calculator can work out {e}.", "Calculator: {e}."]
RESULT_REASONINGS = ["The calculator returned {r}.", "The tool says {e} = {r}.", "So {e} is {r}.", "{r}."]


def _symbols(rng, unicode):
    """Operator symbols for one problem: unicode ones always in the unicode edge case, sometimes otherwise."""
    if unicode or rng.random() < 0.15:
        return {"-": "−", "*": "×", "/": "÷"}
    return {"-": "-", "*": rng.choice(["*", "x"]), "/": "/"}


# Each operation returns (expression, reasoning steps, result) in one of several styles.


def _add(rng, sym):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    r, e = a + b, f"{a} + {b}"
    style = rng.randrange(4)
    if style == 0:  # column addition with a carry
        ones = a % 10 + b % 10
        carry = ones // 10
        steps = (f"Add the ones: {a % 10} + {b % 10} = {ones}"
                 + (f", write {ones % 10} and carry 1. " if carry else ". ")
                 + f"Add the tens: {a // 10} + {b // 10}" + (" + 1" if carry else "")
                 + f" = {a // 10 + b // 10 + carry}. So {e} = {r}.")
    elif style == 1:  # round the second number to a multiple of ten
        c = (b + 5) // 10 * 10
        d = b - c
        fix = f" + {d}" if d > 0 else f" - {-d}"
        steps = f"{e} = {a} + {c}{fix} = {a + c}{fix} = {r}." if d else f"{e} = {r}."
    elif style == 2:  # tens and ones separately
        steps = (f"Split into tens and ones: ({a // 10 * 10} + {b // 10 * 10}) + ({a % 10} + {b % 10}) "
                 f"= {a // 10 * 10 + b // 10 * 10} + {a % 10 + b % 10} = {r}.")
    else:
        steps = f"{e} = {r}."
    return e, steps, r


def _sub(rng, sym):
    a = rng.randint(20, 99)
    b = rng.randint(10, a)
    r, e = a - b, f"{a} {sym['-']} {b}"
    m = sym["-"]
    style = rng.randrange(4)
    if style == 0:  # column subtraction with a borrow
        if a % 10 >= b % 10:
            steps = (f"Ones: {a % 10} {m} {b % 10} = {a % 10 - b % 10}. "
                     f"Tens: {a // 10} {m} {b // 10} = {a // 10 - b // 10}. So {e} = {r}.")
        else:
            steps = (f"Ones: {a % 10} {m} {b % 10} needs a borrow, so {a % 10 + 10} {m} {b % 10} = "
                     f"{a % 10 + 10 - b % 10}. Tens: {a // 10} {m} 1 {m} {b // 10} = {a // 10 - 1 - b // 10}. "
                     f"So {e} = {r}.")
    elif style == 1:  # round the subtrahend up to a multiple of ten
        c = (b + 9) // 10 * 10
        steps = f"{e} = {a} {m} {c} + {c - b} = {a - c} + {c - b} = {r}." if c != b else f"{e} = {r}."
    elif style == 2:  # count up from the smaller number
        c = (b + 9) // 10 * 10
        steps = (f"Count up from {b}: {b} + {c - b} = {c}, then {c} + {a - c} = {a}. "
                 f"That is {c - b} + {a - c} = {r}." if b < c <= a else f"{e} = {r}.")
    else:
        steps = f"{e} = {r}."
    return e, steps, r


def _mul(rng, sym):
    a, b = rng.randint(2, 12), rng.randint(2, 25)
    r, x = a * b, sym["*"]
    e = f"{a} {x} {b}"
    style = rng.randrange(3)
    if style == 0 and b > 10 and b % 10:  # distribute over tens and ones
        steps = f"{e} = {a} {x} {b // 10 * 10} + {a} {x} {b % 10} = {a * (b // 10 * 10)} + {a * (b % 10)} = {r}."
    elif style == 1 and a <= 4:  # repeated addition
        steps = f"{e} means adding {b} {a} times: " + " + ".join([str(b)] * a) + f" = {r}."
    else:
        steps = f"I know that {e} = {r}."
    return e, steps, r


def _div(rng, sym):
    b, q = rng.randint(2, 9), rng.randint(2, 12)
    a, d = b * q, sym["/"]
    e = f"{a} {d} {b}"
    style = rng.randrange(3)
    if style == 0:
        steps = f"{b} {sym['*']} {q} = {a}, so {e} = {q}."
    elif style == 1:  # count in steps of the divisor
        steps = f"Count by {b}s: " + ", ".join(str(b * i) for i in range(1, q + 1)) + f". That is {q} steps."
    else:
        steps = f"{e} = {q}."
    return e, steps, q


def _compare(rng, sym):
    """Unlike the others it returns (question, reasoning, answer): its wording depends on the question."""
    a, b = rng.sample(range(10, 100), 2)
    big, small = max(a, b), min(a, b)
    kind = rng.randrange(3)
    if kind == 0:
        q, r = f"Which is larger, {a} or {b}?", rng.choice([f"{big} is larger.", f"{big}"])
    elif kind == 1:
        q = f"Is {a} greater than {b}?"
        r = f"Yes, {a} is greater than {b}." if a > b else f"No, {a} is less than {b}."
    else:
        q, r = f"Which number is smaller: {a} or {b}?", rng.choice([f"{small} is smaller.", f"{small}"])
    if rng.random() < 0.5 and a // 10 != b // 10:
        steps = f"Compare the tens digits: {big // 10} > {small // 10}, so {big} > {small}."
    else:
        steps = f"{big} {sym['-']} {small} = {big - small}, which is positive, so {big} > {small}."
    return q, steps, r


def _problem(rng, unicode=False):
    """One random problem as (question, reasoning, answer)."""
    sym = _symbols(rng, unicode)
    if not unicode and rng.random() < 0.125:
        question, steps, answer = _compare(rng, sym)
    else:
        e, steps, r = rng.choice([_add, _sub, _mul, _div])(rng, sym)
        question = rng.choice(UNICODE_QUESTIONS if unicode else QUESTIONS).format(e=e)
        answer = rng.choice(UNICODE_ANSWERS if unicode else ANSWERS).format(e=e, r=r)
    if rng.random() < 0.2:
        answer += " " + rng.choice(CLOSINGS)
    return question, rng.choice(OPENERS) + steps, answer


def _calculator_call(expression):
    """The model's call of the calculator (Kimi's id form: functions.NAME:IDX)."""
    return {"id": "functions.calculator:0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression}, ensure_ascii=False)}}


def _tool_record(rng, messages, e, r):
    """A calculator chat at one of its two steps, as a record: the call the model makes for the
    question in `messages` (content empty, "tool_calls" the call), or, after the call and the
    tool's result, its answer."""
    call = _calculator_call(e)
    if rng.random() < 0.5:
        return {"tools": [CALCULATOR], "messages": messages, "reasoning_content": rng.choice(CALL_REASONINGS).format(e=e),
                "content": "", "tool_calls": [call], "finish_reason": "stop"}
    messages = messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "content": str(r), "tool_call_id": call["id"]}]
    return {"tools": [CALCULATOR], "messages": messages,
            "reasoning_content": rng.choice(RESULT_REASONINGS).format(e=e, r=r),
            "content": rng.choice(ANSWERS).format(e=e, r=r), "finish_reason": "stop"}


def _record(rng, kind):
    """One conversation of the given kind, without its id."""
    if kind == "tool":
        e, _, r = rng.choice([_add, _sub, _mul, _div])(rng, _symbols(rng, False))
        return _tool_record(rng, [{"role": "user", "content": rng.choice(QUESTIONS).format(e=e)}], e, r)
    question, reasoning, content = _problem(rng, unicode=kind == "unicode")
    messages = []
    if kind == "system" or (kind == "multi_turn" and rng.random() < 0.3):
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if kind == "multi_turn":
        for _ in range(rng.randint(1, 2)):
            q, _, a = _problem(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        question = rng.choice(FOLLOW_UPS) + question
    if kind == "special_text":
        question = rng.choice(SPECIAL_QUESTIONS).format(q=question)
    messages.append({"role": "user", "content": question})
    finish_reason = "stop"
    if kind == "empty_reasoning":
        reasoning = ""
    elif kind == "cut_reasoning":  # max_tokens hit before </think>
        reasoning, content, finish_reason = reasoning[: rng.randint(1, len(reasoning) - 1)], "", "length"
    elif kind == "cut_content":  # max_tokens hit after </think>
        content = content + " " + rng.choice(CLOSINGS)
        content, finish_reason = content[: rng.randint(1, len(content) - 1)], "length"
    return {"messages": messages, "reasoning_content": reasoning, "content": content,
            "finish_reason": finish_reason}


def generate_records(seed, n, edge_cases):
    """`n` canonical records (docs/CONTRACTS.md), identical for the same seed.

    edge_cases=False: finished conversations for the target's pretraining corpus, ids corpus-000001...
    edge_cases=True: every edge-case kind in turn (n/8 of each), ids demo-00001...
    """
    rng = random.Random(seed)
    records = []
    for i in range(n):
        if edge_cases:
            kind, rid = EDGE_KINDS[i % len(EDGE_KINDS)], f"demo-{i + 1:05d}"
        else:
            kind, rid = rng.choice(PLAIN_KINDS), f"corpus-{i + 1:06d}"
        records.append({"id": rid, **_record(rng, kind)})
    return records


def _prompt(prompt_id, record):
    """A record's prompt: {"id", "messages"}, and its "tools" where it declares any."""
    return {"id": prompt_id, "messages": record["messages"], **({"tools": record["tools"]} if "tools" in record else {})}


def generate_prompts(seed, n):
    """`n` prompts {"id", "messages", "tools"?} (ids prompt-00001...), identical for the same seed."""
    rng = random.Random(seed)
    return [_prompt(f"prompt-{i + 1:05d}", _record(rng, rng.choice(PROMPT_KINDS))) for i in range(n)]


# The demo's own evaluation suite (eval.suites chat): what users ask unlike the training prompts:
# word problems, other phrasings, and longer chats of several earlier turns.
WORD_PROBLEMS = [
    ("A shop has {a} apples and sells {b} of them. How many apples are left?", lambda a, b: (a + b, b, "-")),
    ("There are {a} rows with {b} chairs each. How many chairs is that?", lambda a, b: (a % 12 + 2, b, "*")),
    ("Sam scored {a} points, then {b} more. What is his total?", lambda a, b: (a, b, "+")),
    ("{a} cookies are shared equally by {b} friends. How many does each get?",
     lambda a, b: ((a % 11 + 2) * (b % 8 + 2), b % 8 + 2, "/")),
]
CHAT_QUESTIONS = ["hey, quick q: {e}", "I need {e} worked out, please.", "What do you get for {e}?",
                  "Could you check {e} for me?", "Mental maths time: {e}"]


def _word_problem(rng):
    """A word problem as the question, and the arithmetic it asks for: (question, e, r)."""
    template, numbers = rng.choice(WORD_PROBLEMS)
    a, b, op = numbers(rng.randint(10, 60), rng.randint(2, 30))
    r = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    return template.format(a=a, b=b), f"{a} {op} {b}", r


def generate_chat_suite(seed, n):
    """`n` evaluation prompts {"id", "messages"} (ids chat-001...) unlike generate_prompts': each
    ends on a word problem or a differently phrased sum after 2 to 4 earlier turns."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.4 else []
        for _ in range(rng.randint(2, 4)):
            question, e, r = _word_problem(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": f"{e} = {r}"}]
        if rng.random() < 0.5:
            question = _word_problem(rng)[0]
        else:
            question = rng.choice(CHAT_QUESTIONS).format(e=rng.choice([_add, _sub, _mul, _div])(rng, _symbols(rng, False))[0])
        messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS) + question})
        prompts.append({"id": f"chat-{i + 1:03d}", "messages": messages})
    return prompts


def generate_tool_suite(seed, n):
    """`n` evaluation prompts with the calculator declared (ids tools-001...): a word problem or a
    differently phrased sum, half asking for the call, half after the tool's result."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if rng.random() < 0.5:
            question, e, r = _word_problem(rng)
        else:
            e, _, r = rng.choice([_add, _sub, _mul, _div])(rng, _symbols(rng, False))
            question = rng.choice(CHAT_QUESTIONS).format(e=e)
        prompts.append(_prompt(f"tools-{i + 1:03d}", _tool_record(rng, [{"role": "user", "content": question}], e, r)))
    return prompts


def write_jsonl(path, records):
    """One JSON object per line, unicode kept readable, written atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DEMO_DIR)
    args = parser.parse_args()
    write_jsonl(args.out_dir / "corpus.jsonl", generate_records(seed=1, n=4000, edge_cases=False))
    write_jsonl(args.out_dir / "prompts.jsonl", generate_prompts(seed=3, n=2000))
    write_jsonl(args.out_dir / "raw_responses.jsonl", generate_records(seed=2, n=300, edge_cases=True))
    write_jsonl(args.out_dir / "eval_chat.jsonl", generate_chat_suite(seed=4, n=48))
    write_jsonl(args.out_dir / "eval_tools.jsonl", generate_tool_suite(seed=5, n=24))


if __name__ == "__main__":
    main()
