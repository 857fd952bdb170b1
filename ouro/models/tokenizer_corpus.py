"""Small built-in training corpus for the test/toy BPE tokenizer, kept as text beside this file.

Original text written for this repo: a mix of English prose, Python code, numbers and
punctuation so that merges look like a real tokenizer's. Editing it changes every merge id, so
treat `tokenizer_corpus.txt` as frozen."""

from pathlib import Path

CORPUS = (Path(__file__).with_name("tokenizer_corpus.txt")).read_text(encoding="utf-8")
