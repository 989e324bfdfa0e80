"""Summary of ab_processes*.sh output: per variant, the median speed ratio to attention and the median step
(warm rounds: each process's first step dropped)."""
import sys, json, statistics as st
import collections; rows = collections.defaultdict(list); raw = collections.defaultdict(list)
for line in open(sys.argv[1]):
    e, js = line.split(" ", 1)
    d = json.loads(js); a = d.pop("attention"); m = list(d.values())[0]
    rows[e] += [x / y for x, y in zip(a[1:], m[1:])]; raw[e] += m[1:]
for e in rows:
    print(e, "median speed vs attn %.2f" % st.median(rows[e]), "median step %.3f" % st.median(raw[e]),
          "n", len(rows[e]))
