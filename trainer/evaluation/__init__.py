"""Judging a candidate: its figures on held-out records, and the gate that decides on them."""
