"""Medians of a timing worker's rounds: each mixer's median step and the median of its per-round speed ratios to
attention, over every round and over the warm rounds (the first long step pays first-touch page faults)."""
import json
import statistics as st
import sys

for line in open(sys.argv[1]):
    if line.startswith("#"):
        print(line.strip())
        continue
    d = json.loads(line)
    att = d.pop("attention")
    print(f"attention: median step {st.median(att):.3f} s ({min(att):.2f}-{max(att):.2f})")
    for name, t in d.items():
        r = [a / m for a, m in zip(att, t)]
        print(f"{name}: median step {st.median(t):.3f} s; speed vs attention: median {st.median(r):.2f}x "
              f"(rounds {min(r):.2f}-{max(r):.2f}), warm rounds median {st.median(r[1:]):.2f}x")
