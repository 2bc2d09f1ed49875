"""Sampling and the acceptance math, as pure functions of tensors: sampling parameters and the target's
distribution (`sampling.py`); greedy acceptance and rejection sampling for chains and trees
(`acceptance.py`)."""
