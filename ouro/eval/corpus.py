"""The text corpus ouro trains its built-in model on and measures quality with.

Default: the running Python's standard library `.py` files (present on every machine), tests
excluded. Files are split into train and held-out by a hash of their path relative to the root,
so the split does not depend on the order files are listed in or on which other files exist.
Documents are scored (and trained) as `<|endoftext|>` + the file's tokens, so every byte of a
file is predicted exactly once; bits/byte divides by the file's UTF-8 length.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
HELD_OUT_PERCENT = 5


@dataclass(frozen=True)
class Document:
    path: str            # relative to the corpus root
    text: str

    @property
    def n_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


def default_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str, percent: int = HELD_OUT_PERCENT) -> bool:
    digest = hashlib.sha1(relative_path.replace("\\", "/").encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < percent


def corpus_files(root: str | Path | None = None) -> list[Path]:
    root = Path(root) if root is not None else default_root()
    if not root.is_dir():
        raise ValueError(f"corpus {root} is not a directory")
    files = []
    for p in sorted(root.rglob("*.py")):
        parts = set(p.relative_to(root).parts[:-1])
        if parts & EXCLUDED_PARTS or p.name.startswith("test_") or not p.is_file():
            continue
        files.append(p)
    if not files:
        raise ValueError(f"corpus {root} has no .py files outside test directories")
    return files


def load_split(split: str, root: str | Path | None = None, max_bytes: int | None = None,
               percent: int = HELD_OUT_PERCENT) -> list[Document]:
    """The `train` or `held_out` documents of the corpus, in path order. `max_bytes` keeps a
    prefix of the list (whole files) that fits, at least one file: quick runs and tests."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    root = Path(root) if root is not None else default_root()
    docs, total = [], 0
    for p in corpus_files(root):
        rel = p.relative_to(root).as_posix()
        if is_held_out(rel, percent) != (split == "held_out"):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue                                  # a file that is not UTF-8 text is skipped
        if not text:
            continue
        if max_bytes is not None and docs and total + len(text.encode()) > max_bytes:
            break
        docs.append(Document(rel, text))
        total += docs[-1].n_bytes
    if not docs:
        raise ValueError(f"corpus {root} has no {split} files (held-out share {percent}%)")
    return docs


def held_out_prefixes(tokenizer, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `n` held-out files that have that many (prompts of
    real code for speed measurements)."""
    out = []
    for doc in load_split("held_out"):
        ids = tokenizer.encode(doc.text).ids
        if len(ids) >= length:
            out.append(ids[:length])
            if len(out) == n:
                return out
    raise ValueError(f"the held-out split has fewer than {n} files of {length} tokens")
