"""Speculative decoding's building blocks: proposing draft tokens, verifying them against the
target's distributions, and choosing how many to draft.

Built and tested on their own, not yet wired into the step loop. ``ngram_proposer`` and
``adaptive_k`` are plain Python (the scheduler's side may use them); ``verification`` uses
torch (the model runner's side). This ``__init__`` imports none of them, so importing the
torch-free modules never pulls torch in.
"""
