"""accounting — what the vault served and what that saved, on evidence.

- counters.py: the Prometheus counters of one service instance, and the committed-restore
  receipt without which no hit is counted (invariant 4).
- pairing.py: paired timings of a local prefill and a later restore of the same cut.
- economics.py: speedup, seconds saved, FLOPs avoided and joules, each labelled measured
  or mock (invariant 8).
"""
