"""The rows of the papers' efficiency tables as configs, for `plan --compare` (BENCHMARKS.md,
"Time per iteration at the papers' settings"). `get_config(row)` takes the row's name:

    python -m tree_grpo_jax.plan --config=benchmarks/paper_settings.py:branchgrpo --devices=8 \\
        --compare=benchmarks/paper_settings.py:dancegrpo,benchmarks/paper_settings.py:mixgrpo,...

BranchGRPO's table (FLUX.1-dev, 720x720 px, 20 steps, HPS-v2.1; its released script runs 8
GPUs with 2 prompts each, 16 images per prompt, 2 train rows per GPU and micro-step and 12
micro-steps per update):

    dancegrpo       DanceGRPO (tf=1.0): 20 SDE steps, every step trained (698 s)
    mixgrpo         MixGRPO (20,5): 20 steps, an SDE window of 5 trained (289 s)
    branchgrpo      BranchGRPO: BRANCH(2) at steps 0, 3, 6, 9, every edge trained (493 s)
    branchgrpo_wp   BranchGRPO with width pruning, half of each branch's children (314 s)
    branchgrpo_mix  BranchGRPO-Mix: SDE in a window of 4 and at the splits (148 s)

The baselines' group size is not in the table; here every row has 16 images per prompt (the
trees' leaves), so that iterations compare at equal images. DanceGRPO's tf=0.6 row (469 s)
trains a random 60% of each chain's steps, which this library does not implement, and the
depth-pruning row (314 s) does not say which depths it prunes: neither is a row here.

TreeGRPO's setting (SD3.5-Medium, 512 px, 10 steps; its release runs 8 GPUs with 2 prompts
each): `treegrpo` (configs/sd35m.py: a window of 4 BRANCH(2) steps, 16 leaves) against
`grpo` (configs/sd35m_grpo.py: flat GRPO, 16 SDE chains, the KL term of Flow-GRPO).
"""

from configs import flux_branchgrpo, flux_mixgrpo, sd35m, sd35m_grpo

DEVICES = 8
PROMPTS_PER_DEVICE = 2


def _flux(c):
    c.model.path = "builtin:flux-dev"
    c.mesh.fsdp = DEVICES  # full fine-tuning of 12B parameters: the state split eight ways
    c.prompts.batch_size = PROMPTS_PER_DEVICE * DEVICES
    c.train.rows_per_minibatch = 2 * DEVICES
    c.train.grad_accumulation = 12
    return c


def _sd35m(c):
    c.model.path = "builtin:sd35m"
    c.prompts.batch_size = PROMPTS_PER_DEVICE * DEVICES
    c.train.rows_per_minibatch = DEVICES * (2 if c.tree.method == "grpo" else 1)
    return c


def _dancegrpo():
    c = flux_branchgrpo.get_config()
    c.tree.method = "grpo"
    c.tree.group_size = 16
    c.tree.shared_init_noise = True
    return _flux(c)


def _mixgrpo():
    c = flux_mixgrpo.get_config()
    c.sampling.num_steps = 20
    c.tree.window = 5
    c.tree.group_size = 16
    return _flux(c)


def _branchgrpo(pruned: bool = False, mix: bool = False):
    c = flux_branchgrpo.get_config()
    if pruned:
        c.advantage.width_pruning = "top_per_branch"
        c.advantage.width_pruning_ratio = 0.5
    if mix:
        c.tree.method = "branchgrpo_mix"
        c.tree.window = 4
    return _flux(c)


ROWS = {
    "dancegrpo": _dancegrpo,
    "mixgrpo": _mixgrpo,
    "branchgrpo": _branchgrpo,
    "branchgrpo_wp": lambda: _branchgrpo(pruned=True),
    "branchgrpo_mix": lambda: _branchgrpo(mix=True),
    "treegrpo": lambda: _sd35m(sd35m.get_config()),
    "grpo": lambda: _sd35m(sd35m_grpo.get_config()),
}


def get_config(row: str = "branchgrpo"):
    if row not in ROWS:
        raise ValueError(f"unknown row {row!r}; name one of {', '.join(ROWS)}.")
    c = ROWS[row]()
    c.name = f"paper_{row}"
    return c
