"""Generated training snippets: JSON objects, key/value lists and short Q/A.

They teach the tiny model the shapes that structured-output and chat demos ask for
(a JSON object with quoted keys, a list of ``key: value`` lines, a short factual
answer in a chat turn). Everything comes from one seeded ``random.Random``.
"""

from __future__ import annotations

import json
import random

_NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack", "Karen", "Liam",
          "Maria", "Noah", "Olivia", "Paul", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki", "Zoe"]
_CITIES = {"Paris": "France", "Berlin": "Germany", "Madrid": "Spain", "Rome": "Italy", "Lisbon": "Portugal",
           "Vienna": "Austria", "Warsaw": "Poland", "Prague": "Czechia", "Dublin": "Ireland", "Oslo": "Norway",
           "Stockholm": "Sweden", "Helsinki": "Finland", "Athens": "Greece", "Tokyo": "Japan", "Seoul": "South Korea",
           "Beijing": "China", "Delhi": "India", "Cairo": "Egypt", "Nairobi": "Kenya", "Ottawa": "Canada",
           "Lima": "Peru", "Santiago": "Chile", "Canberra": "Australia", "Brasilia": "Brazil", "Mexico City": "Mexico"}
_COLORS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
_ITEMS = ["apple", "book", "chair", "lamp", "pencil", "laptop", "bottle", "guitar", "camera", "bicycle"]
_JOBS = ["engineer", "teacher", "doctor", "artist", "chef", "pilot", "writer", "farmer", "nurse", "student"]
_WORDS = ["python", "model", "token", "cache", "kernel", "stream", "vector", "matrix", "string", "number",
          "window", "expert", "layer", "server", "request", "answer", "question", "value", "object", "list"]


def _person(r: random.Random) -> dict:
    name = r.choice(_NAMES)
    return {"name": name, "age": r.randint(18, 80), "city": r.choice(list(_CITIES)), "job": r.choice(_JOBS),
            "email": f"{name.lower()}{r.randint(1, 99)}@example.com"}


def _product(r: random.Random) -> dict:
    return {"id": r.randint(100, 9999), "item": r.choice(_ITEMS), "color": r.choice(_COLORS),
            "price": round(r.uniform(1, 500), 2), "in_stock": r.random() < 0.7}


def _as_json(obj: dict, r: random.Random) -> str:
    return json.dumps(obj, indent=2 if r.random() < 0.5 else None)


def _as_kv(obj: dict) -> str:
    return "\n".join(f"{k}: {json.dumps(v) if isinstance(v, bool) else v}" for k, v in obj.items())


def _arithmetic(r: random.Random) -> tuple[str, str]:
    a, b = r.randint(0, 99), r.randint(0, 99)
    op, word, value = r.choice([("+", "plus", a + b), ("-", "minus", a - b), ("*", "times", a * b)])
    if r.random() < 0.5:
        return f"What is {a} {word} {b}?", f"{a} {word} {b} is {value}."
    return f"Compute {a} {op} {b}.", f"{a} {op} {b} = {value}"


def _chat_snippet(r: random.Random) -> list[tuple[str, str]]:
    kind = r.randrange(7)
    if kind == 0:
        q, a = _arithmetic(r)
    elif kind == 1:
        city = r.choice(list(_CITIES))
        q, a = r.choice([(f"What is the capital of {_CITIES[city]}?", f"The capital of {_CITIES[city]} is {city}."),
                         (f"Which country is {city} in?", f"{city} is in {_CITIES[city]}.")])
    elif kind == 2:
        p = _person(r)
        q = f"Give me a JSON object describing a person named {p['name']} who is {p['age']} and lives in {p['city']}."
        a = json.dumps({"name": p["name"], "age": p["age"], "city": p["city"]})
    elif kind == 3:
        p = _product(r)
        q = "Convert to JSON:\n" + _as_kv(p)
        a = _as_json(p, r)
    elif kind == 4:
        p = _person(r)
        q = "List the fields of this record as key: value lines.\n" + json.dumps(p)
        a = _as_kv(p)
    elif kind == 5:
        w = r.choice(_WORDS)
        q, a = r.choice([(f"How many letters are in the word {w}?", f"The word {w} has {len(w)} letters."),
                         (f"Spell {w} backwards.", f"{w[::-1]}"),
                         (f"Write {w} in capital letters.", w.upper())])
    else:
        xs = sorted(r.sample(range(100), r.randint(3, 6)))
        shuffled = r.sample(xs, len(xs))
        q, a = r.choice([(f"Sort these numbers: {shuffled}", f"{xs}"),
                         (f"What is the largest of {shuffled}?", f"The largest is {max(xs)}."),
                         (f"What is the sum of {shuffled}?", f"The sum is {sum(xs)}.")])
    return [("user", q), ("assistant", a)]


def _text_snippet(r: random.Random) -> str:
    kind = r.randrange(3)
    if kind == 0:
        people = [_person(r) for _ in range(r.randint(1, 3))]
        return _as_json(people[0], r) if len(people) == 1 else json.dumps(people, indent=2)
    if kind == 1:
        return _as_kv(_product(r) if r.random() < 0.5 else _person(r))
    q, a = _arithmetic(r)
    return f"Q: {q}\nA: {a}"


def generate_snippets(seed: int, n_chat: int = 6000, n_text: int = 3000) -> list[tuple[str, object]]:
    r = random.Random(seed)
    docs: list[tuple[str, object]] = [("chat", _chat_snippet(r)) for _ in range(n_chat)]
    docs += [("text", _text_snippet(r)) for _ in range(n_text)]
    return docs
