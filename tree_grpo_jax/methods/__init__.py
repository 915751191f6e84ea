"""Training methods: the method table (table.py) and the objectives its entries train through.

    objective.py  what an objective is to the run (`Objective`, `RowSource`)
    ppo.py        PPO-clip on the rollout's own steps (`PPO`)
    nft.py        DiffusionNFT on forward-noised leaves, with its old policy (`NFT`)
    awm.py, dgpo.py, dpo.py, crd.py   AWM, DGPO, online Diffusion-DPO and CRD, likewise
    forward.py    what those forward-process objectives share (`ForwardObjective`, their
                  credit, time draws, old-policy mixing and counts)
    node_credit.py  node rewards' checks, node pruning's survival and their counts
    table.py      every method as one `Method` entry; `get(name)` looks one up, `register`
                  adds one

A new objective is one module subclassing `Objective` and the table entries that use it.
Nothing outside this package asks which objective a method has: it calls the objective.
"""

from tree_grpo_jax.methods.objective import Objective, RowSource
from tree_grpo_jax.methods.table import (
    METHODS,
    AdvantageFn,
    Credit,
    EdgeMaskFn,
    Method,
    SpecBuilder,
    UnknownMethodError,
    get,
    methods_of,
    objectives,
    other_sections,
    register,
    unregister,
)

__all__ = [
    "METHODS",
    "AdvantageFn",
    "Credit",
    "EdgeMaskFn",
    "Method",
    "Objective",
    "RowSource",
    "SpecBuilder",
    "UnknownMethodError",
    "get",
    "methods_of",
    "objectives",
    "other_sections",
    "register",
    "unregister",
]
