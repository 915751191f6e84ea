"""tree_grpo_jax: online RL post-training of text-to-image diffusion and flow models with
tree-structured GRPO (TreeGRPO, BranchGRPO) and flat GRPO, all as configurations of one tree
engine.

The way through: `tree_spec` (a static tree) -> `rollout` (each level one batched array) ->
`advantages` (credit; `methods` maps a method name to its tree and credit) -> `transitions`
(trainable edges as rows) -> `train_step` (PPO-clip). `trainer` runs one iteration of that,
`build` makes a run from a config, `train` is the loop and `main` the command line. Models
sit behind `models.base.TextToImageModel`, registered per family in `models/<family>/`;
rewards in the `rewards` registry; weight files are read and written by `weights`.
"""
