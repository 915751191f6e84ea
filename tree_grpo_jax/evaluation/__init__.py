"""Evaluating a run: sample diversity and the eval guard against reward hacking."""
