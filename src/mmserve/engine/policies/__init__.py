"""The scheduler's policies: what sets requests apart, beside the core loop (`engine/scheduler.py`).

- `lane.py`: lanes, each a class of requests with its own waiting queue, run in order each step;
  `fairness.py` (the users' lane, in fair-share order) and `shadows.py` (the cache verifier's
  re-runs, last) are the two.
- `first_tokens.py`: answering a repeated plain greedy prompt's first token at admission.
- `siblings.py`: an n > 1 request's completions, held until the first has scheduled its prompt.
"""
