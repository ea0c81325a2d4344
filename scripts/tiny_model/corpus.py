"""Training text that needs no download: what ships with Python and with PyPI packages.

Sources (each document tagged with its source so the mix and the split are recorded):
* ``pydoc``: ``pydoc_data.topics`` (the language reference topics behind ``help()``);
* ``stdlib``: docstrings of the standard library's own source files (read with ``ast``,
  nothing is imported, so no module runs);
* ``numpy``: docstrings of the installed numpy's source files, the same way;
* ``chat``: the chatterbot-corpus package's English dialogues (YAML);
* ``snippets``: generated JSON objects, key/value lists and short Q/A (snippets.py).

A document is ``("text", str)`` or ``("chat", [(role, content), ...])``. The order is
fixed (sorted paths, sorted keys), so the same installed versions give the same corpus.
"""

from __future__ import annotations

import ast
import glob
import importlib.metadata
import os
import platform
import sysconfig

from scripts.tiny_model.snippets import generate_snippets

# stdlib folders that are tests, demos, GUI tooling or vendored copies, not library docs
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages",
              "dist-packages", "__pycache__", "tkinter", "pydoc_data"}
_MIN_DOC_CHARS = 40


def _docstrings_of_file(path: str, module: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    docs = []

    def visit(node: ast.AST, prefix: str) -> None:
        doc = ast.get_docstring(node, clean=True) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
        name = prefix if isinstance(node, ast.Module) else f"{prefix}.{node.name}"
        if doc and len(doc) >= _MIN_DOC_CHARS:
            docs.append(f"{name}\n\n{doc.strip()}")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, name)

    visit(tree, module)
    return docs


def _source_docstrings(root: str, package: str) -> list[str]:
    """Docstrings of every .py file under ``root`` (sorted walk, test folders skipped)."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].replace(os.sep, ".")
            module = ".".join(p for p in (package, rel.removesuffix(".__init__").removesuffix("__init__")) if p)
            out.extend(_docstrings_of_file(os.path.join(dirpath, name), module))
    return out


def _dedupe(docs: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for d in docs:
        body = d.split("\n\n", 1)[-1]
        if body not in seen:
            seen.add(body)
            out.append(d)
    return out


def _pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics

    return [f"{key}\n\n{topics[key].strip()}" for key in sorted(topics)]


def _chat_dialogues() -> list[list[tuple[str, str]]]:
    import chatterbot_corpus
    import yaml

    root = os.path.join(os.path.dirname(chatterbot_corpus.__file__), "data", "english")
    dialogues = []
    for path in sorted(glob.glob(os.path.join(root, "*.yml"))):
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        for conv in data.get("conversations") or []:
            lines = [str(x).strip() for x in conv if str(x).strip()]
            if len(lines) >= 2:
                roles = ["user" if i % 2 == 0 else "assistant" for i in range(len(lines))]
                dialogues.append(list(zip(roles, lines)))
    return dialogues


def build_corpus(seed: int) -> tuple[list[tuple[str, str, object]], dict]:
    """(documents as (source, kind, payload), manifest naming every source and version)."""
    import numpy

    stdlib = sysconfig.get_paths()["stdlib"]
    sources = {
        "pydoc": [("text", d) for d in _pydoc_topics()],
        "stdlib": [("text", d) for d in _dedupe(_source_docstrings(stdlib, ""))],
        "numpy": [("text", d) for d in _dedupe(_source_docstrings(os.path.dirname(numpy.__file__), "numpy"))],
        "chat": [("chat", c) for c in _chat_dialogues()],
        "snippets": generate_snippets(seed),
    }
    docs = [(src, kind, payload) for src, items in sources.items() for kind, payload in items]

    def size(kind, payload):
        return len(payload) if kind == "text" else sum(len(c) for _, c in payload)

    manifest = {
        "python": platform.python_version(),
        "pydoc_data.topics": f"Python {platform.python_version()} standard library",
        "stdlib_source": stdlib,
        "numpy": numpy.__version__,
        "chatterbot-corpus": importlib.metadata.version("chatterbot-corpus"),
        "snippets_seed": seed,
        "documents": {src: len(items) for src, items in sources.items()},
        "characters": {src: sum(size(k, p) for k, p in items) for src, items in sources.items()},
    }
    return docs, manifest
