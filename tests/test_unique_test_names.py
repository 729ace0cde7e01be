"""Test files are imported by basename (the test folders are not packages): two with one name stop pytest at
collection, the whole suite with them. Caught here with the names, before CI's collection error does."""
from __future__ import annotations

from collections import Counter
from pathlib import Path


def test_test_file_basenames_are_unique():
    files = sorted((Path(__file__).parent).rglob("test_*.py"))
    counts = Counter(f.name for f in files)
    assert not [f for f in files if counts[f.name] > 1]
