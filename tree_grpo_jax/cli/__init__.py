"""The commands (`python -m tree_grpo_jax.main|evaluate|sample|export`; `plan` has its own
sub-package, `tree_grpo_jax.plan`)."""
