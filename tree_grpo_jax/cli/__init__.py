"""The commands (`python -m tree_grpo_jax.main|plan|evaluate|sample|export`)."""
