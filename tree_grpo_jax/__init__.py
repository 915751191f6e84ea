"""tree_grpo_jax: online RL post-training of text-to-image diffusion and flow models with
tree-structured GRPO (TreeGRPO, BranchGRPO) and flat GRPO, all as configurations of one tree
engine.

The way through, one folder each: `core` (`tree_spec` a static tree -> `rollout` each level
one batched array -> `advantages` the credit -> `transitions` trainable edges as rows), then
`methods` (the method table and its objectives: PPO-clip, DiffusionNFT), then `run` (`build`
makes a run from a config, `trainer` runs one iteration, `train_step` the update, `loop` the
loop, `checkpoint` resume), and `cli` the commands. Models sit behind
`models.base.TextToImageModel`, registered per family in `models/<family>/`; rewards in the
`rewards` registry; weight files are read and written by `weights`.
"""

import importlib

# Modules that stood at the top before the package had folders: `from tree_grpo_jax import
# rollout` keeps working for code written against that layout.
_MOVED = {
    **{
        name: f"core.{name}"
        for name in (
            "tree_spec",
            "sampling",
            "guidance",
            "rollout",
            "advantages",
            "pruning",
            "transitions",
            "loss",
        )
    },
    **{
        name: f"run.{name}"
        for name in (
            "build",
            "trainer",
            "train_step",
            "checkpoint",
            "identity",
            "fingerprint",
            "workdir",
            "precompile",
            "compile_cache",
            "memory_plan",
            "reporting",
            "prompts",
        )
    },
    "nft": "methods.nft",
    "diversity": "evaluation.diversity",
    "guard": "evaluation.guard",
}


def __getattr__(name: str):
    if name in _MOVED:
        return importlib.import_module(f"{__name__}.{_MOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
