"""Solver stage: the MILP formulation and its backends, the restricted and dense formulations,
heuristics and baselines, and ``solve()``, which chooses recomputation and paging for least energy."""
