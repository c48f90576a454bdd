"""Write the small, deterministic data files of the EAGLE-3 example run (``run.toml``).

The rows imitate the mix of a real draft-model data run: function calling with ``tools``,
code, chat, math, multilingual chat, long documents, OpenAI batch lines and multi-turn
agentic traces with tool calls and tool results, plus two pass-through sets (finished
conversations and pre-tokenised rows). They are built from word lists with a seeded
generator, so running this again gives the same bytes; the tests check that.

    python examples/eagle3/make_data.py [--out DIR]   (default: the data/ folder beside it)
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Row = dict[str, Any]

# --- function calling ------------------------------------------------------------------------


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> Row:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _s(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _n(description: str) -> dict[str, Any]:
    return {"type": "number", "description": description}


TOOLS: dict[str, Row] = {
    "get_weather": _tool(
        "get_weather",
        "Current weather for a city.",
        {"city": _s("City name"), "unit": _s("Temperature unit", enum=["celsius", "fahrenheit"])},
        ["city"],
    ),
    "search_flights": _tool(
        "search_flights",
        "Search one-way flights between two airports on a date.",
        {
            "origin": _s("IATA code of the departure airport"),
            "destination": _s("IATA code of the arrival airport"),
            "date": _s("Departure date, YYYY-MM-DD"),
        },
        ["origin", "destination", "date"],
    ),
    "convert_currency": _tool(
        "convert_currency",
        "Convert an amount between two currencies at today's rate.",
        {"amount": _n("Amount to convert"), "from": _s("ISO code"), "to": _s("ISO code")},
        ["amount", "from", "to"],
    ),
    "get_stock_price": _tool(
        "get_stock_price",
        "Latest trading price of a stock.",
        {"symbol": _s("Ticker symbol")},
        ["symbol"],
    ),
    "create_event": _tool(
        "create_event",
        "Add an event to the user's calendar.",
        {
            "title": _s("Event title"),
            "start": _s("Start time, ISO 8601"),
            "duration_minutes": _n("Length of the event"),
        },
        ["title", "start"],
    ),
    "send_email": _tool(
        "send_email",
        "Send an email on the user's behalf.",
        {"to": _s("Recipient address"), "subject": _s("Subject line"), "body": _s("Text")},
        ["to", "subject", "body"],
    ),
    "search_restaurants": _tool(
        "search_restaurants",
        "Find restaurants in a city.",
        {
            "city": _s("City name"),
            "cuisine": _s("Kind of food"),
            "max_price": _n("Highest price level, 1 to 4"),
        },
        ["city"],
    ),
}

CITIES = ("Lisbon", "Osaka", "Toronto", "Nairobi", "Berlin", "Lima", "Hanoi", "Oslo")
AIRPORTS = ("LIS", "KIX", "YYZ", "NBO", "BER", "LIM", "HAN", "OSL")
CURRENCIES = ("EUR", "JPY", "CAD", "KES", "USD", "PEN", "VND", "NOK")
TICKERS = ("AAPL", "NVDA", "MSFT", "ASML", "TSM", "SAP")
CUISINES = ("vegetarian", "seafood", "ramen", "Ethiopian", "tapas", "Peruvian")
NAMES = ("Ana", "Kenji", "Priya", "Lukas", "Wanjiru", "Mateo", "Linh", "Ingrid")


def _toolcall_query(rng: random.Random, tool: str) -> str:
    city = rng.choice(CITIES)
    if tool == "get_weather":
        return f"Do I need an umbrella in {city} right now?"
    if tool == "search_flights":
        a, b = rng.sample(AIRPORTS, 2)
        return (
            f"Find me a flight from {a} to {b} on 2025-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}."
        )
    if tool == "convert_currency":
        a, b = rng.sample(CURRENCIES, 2)
        return f"How much is {rng.randint(20, 5000)} {a} in {b}?"
    if tool == "get_stock_price":
        return f"What is {rng.choice(TICKERS)} trading at?"
    if tool == "create_event":
        name = rng.choice(NAMES)
        minutes, hour = rng.choice((30, 45, 60)), rng.randint(8, 17)
        return f"Put a {minutes}-minute call with {name} in my calendar tomorrow at {hour}:00."
    if tool == "send_email":
        name = rng.choice(NAMES)
        return (
            f"Email {name.lower()}@example.com that the report will be one day late, and apologise."
        )
    return f"Any good {rng.choice(CUISINES)} places in {city} that are not too expensive?"


def toolcalls(rng: random.Random, n: int = 40) -> Iterator[Row]:
    names = sorted(TOOLS)
    for i in range(1, n + 1):
        offered = rng.sample(names, rng.randint(2, 4))
        messages: list[Row] = []
        if rng.random() < 0.4:
            messages.append(
                {
                    "role": "system",
                    "content": "You are a personal assistant. Call a tool when one fits; "
                    "otherwise answer directly.",
                }
            )
        messages.append({"role": "user", "content": _toolcall_query(rng, rng.choice(offered))})
        row: Row = {"id": f"toolcalls-{i:03d}", "messages": messages}
        row["tools"] = [TOOLS[name] for name in offered]
        if rng.random() < 0.3:
            row["tool_choice"] = "auto"
        yield row


# --- code ------------------------------------------------------------------------------------

LANGUAGES = ("Python", "Rust", "TypeScript", "Go", "C++", "SQL", "Bash")
CODE_TASKS = (
    "parses an ISO 8601 duration such as P3DT4H into seconds",
    "merges overlapping intervals in a list",
    "returns the k most frequent words in a text",
    "checks whether a string of brackets is balanced",
    "computes the Levenshtein distance between two strings",
    "implements an LRU cache with a fixed capacity",
    "streams a large CSV file and sums one column",
    "finds the shortest path in a grid with obstacles",
    "retries an HTTP request with exponential backoff and jitter",
    "validates an email address without a regular expression",
)
CODE_ASKS = (
    "Write a {lang} function that {task}. Include tests.",
    "Here is my plan: a {lang} function that {task}. What edge cases should I handle? "
    "Then write it.",
    "Review this idea and implement it in {lang}: a function that {task}.",
    "Explain the time complexity of a {lang} function that {task}, then write it.",
)
SQL_ASKS = (
    "Write a SQL query over orders(id, customer_id, total, created_at) that returns each "
    "customer's three largest orders of {year}.",
    "Given events(user_id, kind, at), write SQL for the daily active users of {year}, "
    "with a seven-day moving average.",
)


def code(rng: random.Random, n: int = 40) -> Iterator[Row]:
    for i in range(1, n + 1):
        lang = rng.choice(LANGUAGES)
        if lang == "SQL":
            prompt = rng.choice(SQL_ASKS).format(year=rng.randint(2019, 2024))
        else:
            prompt = rng.choice(CODE_ASKS).format(lang=lang, task=rng.choice(CODE_TASKS))
        row: Row = {"id": f"code-{i:03d}", "prompt": prompt}
        if rng.random() < 0.5:
            row["system"] = "You are an expert programmer. Prefer clear, tested code."
        yield row


# --- chat (ShareGPT) -------------------------------------------------------------------------

CHAT_OPENERS = (
    "I want to start running but I get bored quickly. Any ideas?",
    "How do I politely decline a wedding invitation?",
    "What should I look for when buying a used bicycle?",
    "Can you help me plan a three-day trip to {city}?",
    "My sourdough starter smells like nail polish remover. Is it dead?",
    "How do I explain to my manager that my workload is too high?",
    "What is a good way to learn to touch type as an adult?",
    "Suggest a board game for four people who do not like long rules.",
)
CHAT_FOLLOW_UPS = (
    "That helps. Can you make it shorter?",
    "What would you do first?",
    "And if I only have twenty minutes a day?",
    "Could you give me a concrete example?",
)
CHAT_OLD_REPLIES = (
    "Good question. Here are a few things to consider.",
    "Sure. Let us go through it step by step.",
    "Happy to help. The short answer is: it depends on a few factors.",
)


def chat(rng: random.Random, n: int = 40) -> Iterator[Row]:
    for i in range(1, n + 1):
        turns = [
            {"from": "human", "value": rng.choice(CHAT_OPENERS).format(city=rng.choice(CITIES))}
        ]
        for _ in range(rng.randint(0, 2)):
            turns.append({"from": "gpt", "value": rng.choice(CHAT_OLD_REPLIES)})
            turns.append({"from": "human", "value": rng.choice(CHAT_FOLLOW_UPS)})
        # The source dataset's own last answer: dropped on enqueue, the model writes its own.
        turns.append({"from": "gpt", "value": rng.choice(CHAT_OLD_REPLIES)})
        yield {"id": f"chat-{i:03d}", "conversations": turns}


# --- math ------------------------------------------------------------------------------------


def _math_problem(rng: random.Random) -> str:
    kind = rng.randrange(6)
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    if kind == 0:
        return (
            f"A train leaves at 08:{rng.randint(10, 59)} travelling at {a * 5} km/h. A second "
            f"train leaves the same station {c * 10} minutes later at {a * 5 + b * 2} km/h. "
            "When does the second train catch up?"
        )
    if kind == 1:
        return f"Find all integer solutions of x^2 - {a + b}x + {a * b} = 0, and explain why."
    if kind == 2:
        return f"Prove that the sum of the first {a} odd numbers is {a}^2, then generalise."
    if kind == 3:
        return (
            f"A bag holds {a} red and {b} blue marbles. Draw {c} without replacement. What is "
            "the probability that exactly two are red?"
        )
    if kind == 4:
        return f"Compute the remainder of {a}^{b * 10 + c} divided by {c + 10}."
    return (
        f"How many ways can {c + 3} people sit around a round table if two of them refuse "
        "to sit next to each other?"
    )


def math(rng: random.Random, n: int = 40) -> Iterator[Row]:
    for i in range(1, n + 1):
        prompt = _math_problem(rng)
        if rng.random() < 0.5:
            prompt += " Put the final answer in \\boxed{}."
        yield {"id": f"math-{i:03d}", "prompt": prompt}


# --- multilingual ----------------------------------------------------------------------------

MULTILINGUAL = (
    ("fr", "Explique-moi simplement comment fonctionne la photosynthèse."),
    ("fr", "Peux-tu écrire un court poème sur la mer en hiver ?"),
    ("de", "Wie funktioniert ein Kühlschrank? Bitte einfach erklärt."),
    ("de", "Schreib mir eine höfliche E-Mail, um einen Termin zu verschieben."),
    ("es", "¿Cuáles son las causas principales del cambio climático?"),
    ("es", "Dame tres ideas para una cena vegetariana rápida."),
    ("pt", "Como posso melhorar a minha pronúncia em inglês?"),
    ("it", "Qual è la differenza tra un virus e un batterio?"),
    ("zh", "请用简单的语言解释什么是机器学习。"),
    ("zh", "帮我写一段关于春天的短文。"),
    ("ja", "東京で一日観光するなら、どこに行けばいいですか？"),
    ("ko", "건강한 아침 식사 메뉴를 추천해 주세요."),
    ("ru", "Объясни, почему небо голубое."),
    ("ar", "ما هي فوائد القراءة اليومية؟"),
    ("hi", "समय प्रबंधन के लिए कुछ सुझाव दीजिए।"),
    ("tr", "Yeni bir dil öğrenmenin en iyi yolu nedir?"),
)
REPLY_IN = "Answer in the language of the question."


def multilingual(rng: random.Random, n: int = 40) -> Iterator[Row]:
    for i in range(1, n + 1):
        lang, question = rng.choice(MULTILINGUAL)
        messages: list[Row] = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": REPLY_IN})
        messages.append({"role": "user", "content": question})
        yield {"id": f"multilingual-{i:03d}", "lang": lang, "messages": messages}


# --- long documents --------------------------------------------------------------------------

REPORT_SUBJECTS = ("warehouse robots", "a city bike-share scheme", "a hospital triage app")
REPORT_SENTENCES = (
    "In the {q} quarter, {subject} handled {n} requests, {p} percent more than planned.",
    "The team traced most delays to {cause}, which affected {p} percent of the cases.",
    "Costs rose by {p} percent, mainly because of {cause}.",
    "A pilot in {city} cut waiting times from {n} to {m} minutes.",
    "Users rated the service {r} out of 5, with {cause} as the most common complaint.",
    "The board asked for a plan to address {cause} before the next review.",
)
CAUSES = ("staff shortages", "software updates", "supplier delays", "bad weather", "training")
QUARTERS = ("first", "second", "third", "fourth")
DOC_ASKS = (
    "Summarise the report above in five bullet points.",
    "What are the three biggest risks in the report above, and what would you do about them?",
    "Write a one-paragraph executive summary of the report above.",
)


def longdoc(rng: random.Random, n: int = 20) -> Iterator[Row]:
    for i in range(1, n + 1):
        subject = rng.choice(REPORT_SUBJECTS)
        sentences = [
            rng.choice(REPORT_SENTENCES).format(
                q=rng.choice(QUARTERS),
                subject=subject,
                n=rng.randint(100, 9000),
                m=rng.randint(5, 60),
                p=rng.randint(2, 40),
                r=rng.randint(2, 5),
                cause=rng.choice(CAUSES),
                city=rng.choice(CITIES),
            )
            for _ in range(rng.randint(25, 45))
        ]
        paragraphs = [" ".join(sentences[k : k + 5]) for k in range(0, len(sentences), 5)]
        document = f"Annual report: {subject}\n\n" + "\n\n".join(paragraphs)
        content = f"{document}\n\n{rng.choice(DOC_ASKS)}"
        yield {"id": f"longdoc-{i:03d}", "messages": [{"role": "user", "content": content}]}


# --- writing (OpenAI batch lines) ------------------------------------------------------------

WRITING_ASKS = (
    "Write a short story about {who} who finds {what}.",
    "Write a product description for {what}, aimed at {who}.",
    "Write a limerick about {who} and {what}.",
    "Draft a speech {who} could give about {what}.",
)
WHO = ("a retired lighthouse keeper", "a nervous robot", "a school librarian", "twin astronauts")
WHAT = ("a map with no names", "a self-watering plant pot", "a very old key", "a silent piano")


def writing(rng: random.Random, n: int = 30) -> Iterator[Row]:
    for i in range(1, n + 1):
        ask = rng.choice(WRITING_ASKS).format(who=rng.choice(WHO), what=rng.choice(WHAT))
        # No "model" or "max_tokens" in the body: a body's fields override the dataset's.
        yield {
            "custom_id": f"writing-{i:03d}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": ask}]},
        }


# --- agentic traces --------------------------------------------------------------------------

AGENT_TOOLS: list[Row] = [
    _tool("list_files", "List the files under a folder.", {"path": _s("Folder")}, ["path"]),
    _tool("read_file", "Read a text file.", {"path": _s("File path")}, ["path"]),
    _tool(
        "run_command",
        "Run a shell command in the repository and return its output.",
        {"command": _s("The command line")},
        ["command"],
    ),
    _tool(
        "edit_file",
        "Replace one exact snippet in a file.",
        {"path": _s("File path"), "old": _s("Text to replace"), "new": _s("Replacement")},
        ["path", "old", "new"],
    ),
    _tool("web_search", "Search the web.", {"query": _s("Search terms")}, ["query"]),
]
# (symptom, file, the line with the bug, the snippet to replace, its replacement)
BUGS = (
    (
        "tests/test_dates.py::test_leap_year fails",
        "src/dates.py",
        "    return year % 4 == 0",
        "year % 4 == 0",
        "calendar.isleap(year)",
    ),
    (
        "the CLI crashes on an empty config file",
        "src/config.py",
        "    data = toml.load(f)",
        "data = toml.load(f)",
        "data = toml.load(f) or {}",
    ),
    (
        "pagination skips the last page",
        "src/api.py",
        "    for page in range(1, pages):",
        "range(1, pages)",
        "range(1, pages + 1)",
    ),
    (
        "the cache never expires entries",
        "src/cache.py",
        "    if age > ttl:",
        "age > ttl",
        "age >= ttl",
    ),
)


class _Calls:
    """Numbers tool calls within one trace, as servers do (call_1, call_2, ...)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, name: str, **arguments: Any) -> Row:
        self.n += 1
        return {
            "id": f"call_{self.n}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)},
        }


def _turn(calls: list[Row], content: str = "") -> Row:
    return {"role": "assistant", "content": content, "tool_calls": calls}


def _result(call: Row, content: str) -> Row:
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def agentic(rng: random.Random, n: int = 24) -> Iterator[Row]:
    for i in range(1, n + 1):
        symptom, path, line, old, new = rng.choice(BUGS)
        call = _Calls()
        messages: list[Row] = [
            {
                "role": "system",
                "content": "You are a coding agent working in a git repository. Use the tools "
                "to inspect and change files; finish with a short summary of what you changed.",
            },
            {"role": "user", "content": f"Please fix this: {symptom}."},
        ]
        ls = call("list_files", path="src")
        messages += [
            _turn([ls], "Let me look at the layout first."),
            _result(ls, "src/api.py\nsrc/cache.py\nsrc/config.py\nsrc/dates.py\nsrc/cli.py"),
        ]
        read = call("read_file", path=path)
        body = "\n".join(f"    x{k} = {rng.randint(0, 99)}" for k in range(rng.randint(3, 12)))
        messages += [
            _turn([read]),
            _result(read, f"def check(year, pages, age, ttl, f):\n{body}\n{line}\n"),
        ]
        if rng.random() < 0.5:
            search = call("web_search", query=f"python idiom {old}")
            messages += [
                _turn([search], "I want to confirm the usual idiom before editing."),
                _result(search, "1. Python docs - recommended approach ... 2. Stack Overflow ..."),
            ]
        edit = call("edit_file", path=path, old=old, new=new)
        test = call("run_command", command="python -m pytest -q")
        messages += [
            _turn([edit]),
            _result(edit, "ok: 1 replacement"),
            _turn([test]),
            _result(
                test, f"{rng.randint(20, 90)} passed in {rng.randint(1, 9)}.{rng.randint(10, 99)}s"
            ),
            {
                "role": "assistant",
                "content": f"Fixed: in {path} I replaced `{old}` with `{new}`. All tests pass.",
            },
        ]
        if rng.random() < 0.3:
            messages.append(
                {"role": "user", "content": "Thanks. Can you also add a regression test?"}
            )
            add = call(
                "edit_file", path="tests/test_regression.py", old="", new="def test_fix(): ..."
            )
            messages += [
                _turn([add]),
                _result(add, "ok: file created"),
                {"role": "assistant", "content": "Added tests/test_regression.py."},
            ]
        yield {"id": f"agentic-{i:03d}", "messages": messages, "tools": AGENT_TOOLS}


# --- pass-through: finished conversations ----------------------------------------------------

FINAL_PAIRS = (
    ("What is the capital of Australia?", "Canberra.", "The user asks for a capital. Canberra."),
    ("Give me a synonym for 'quick'.", "Fast, rapid or swift.", "Simple lexical question."),
    ("Is 91 a prime number?", "No: 91 = 7 × 13.", "Check small divisors: 7 × 13 = 91."),
    ("Convert 5 miles to kilometres.", "About 8.05 km.", "1 mile = 1.609 km, times 5."),
    ("What does HTTP 404 mean?", "The server could not find the requested resource.", ""),
    ("Name three noble gases.", "Helium, neon and argon.", "Group 18 elements."),
)


def final_chats(rng: random.Random, n: int = 30) -> Iterator[Row]:
    for i in range(1, n + 1):
        question, answer, reasoning = rng.choice(FINAL_PAIRS)
        final: Row = {"role": "assistant", "content": answer}
        if reasoning:
            final["reasoning_content"] = reasoning
        messages = [{"role": "user", "content": question}, final]
        yield {"id": f"final-{i:03d}", "messages": messages}


# --- pass-through: pre-tokenised rows --------------------------------------------------------

# Qwen2/Qwen3 vocabulary ids for the chat markup; the text tokens are arbitrary ids.
IM_START, IM_END, NEWLINE, USER, ASSISTANT = 151644, 151645, 198, 872, 77091


def pretokenised(rng: random.Random, n: int = 20) -> Iterator[Row]:
    for i in range(1, n + 1):
        prompt = [rng.randint(200, 150000) for _ in range(rng.randint(10, 60))]
        answer = [rng.randint(200, 150000) for _ in range(rng.randint(40, 200))]
        head = [IM_START, USER, NEWLINE, *prompt, IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]
        tail = [*answer, IM_END]
        # loss_mask: 1 where the draft model learns (the answer and its end marker).
        yield {
            "id": f"tokens-{i:03d}",
            "input_ids": head + tail,
            "loss_mask": [0] * len(head) + [1] * len(tail),
        }


# ---------------------------------------------------------------------------------------------

FILES: dict[str, tuple[Callable[[random.Random], Iterator[Row]], int]] = {
    "toolcalls.jsonl": (toolcalls, 1),
    "code.jsonl": (code, 2),
    "chat.jsonl": (chat, 3),
    "math.jsonl": (math, 4),
    "multilingual.jsonl": (multilingual, 5),
    "longdoc.jsonl": (longdoc, 6),
    "writing.jsonl": (writing, 7),
    "agentic.jsonl": (agentic, 8),
    "final_chats.jsonl": (final_chats, 9),
    "pretokenised.jsonl": (pretokenised, 10),
}


def write_all(out: Path) -> dict[str, int]:
    """Write every data file into ``out``; returns the number of rows per file."""
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    for name, (make, seed) in FILES.items():
        rows = list(make(random.Random(seed)))
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        (out / name).write_text(text, encoding="utf-8")
        counts[name] = len(rows)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    args = parser.parse_args(argv)
    for name, count in write_all(args.out).items():
        print(f"{args.out / name}: {count} rows")


if __name__ == "__main__":
    main()
