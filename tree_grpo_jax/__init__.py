"""tree_grpo_jax: online RL post-training of text-to-image diffusion and flow models with
tree-structured GRPO (TreeGRPO, BranchGRPO) and flat GRPO, all as configurations of one tree
engine.

The way through, one folder each: `core` (`tree_spec` a static tree -> `rollout` each level
one batched array -> `advantages` the credit -> `transitions` trainable edges as rows), then
`methods` (the method table and its objectives: PPO-clip, DiffusionNFT), then `run` (`build`
makes a run from a config, `trainer` runs one iteration, `train_step` the update, `loop` the
loop, `checkpoint` resume), `cli` the commands and `plan` the fit and time of a run before
it starts. Models sit behind `models.base.TextToImageModel`, registered per family in
`models/<family>/`; rewards in the `rewards` registry; weight files are read and written by
`weights`.
"""
