"""The held-out retrieval set (issue 44): five public PDFs that bench/realdocs does not contain, labelled by the
protocol in README.md before any retrieval ran on them, and used only to report (`mmrag retrieval eval --held-out
DIR`): every weight, rule and threshold is chosen on mmrag/bench/realdocs."""

from pathlib import Path

SOURCES = Path(__file__).with_name("sources.json")
LABELS = Path(__file__).with_name("labels.jsonl")
