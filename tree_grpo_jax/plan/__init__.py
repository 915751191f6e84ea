"""Will a run fit, and how long will it take? The `plan` command (`python -m tree_grpo_jax.plan`)
and what it reads: the run's programs compiled from shapes with XLA's memory analysis of each
(`memory_plan`), their loop-counted FLOPs and bytes (`program_cost`), the roofline estimate of
an iteration's seconds (`time_plan`) on a named accelerator (`accelerators`), the memory
verdicts (`fit`) and the tables (`time_table`). It sits above the run: nothing in a training
run imports it."""
