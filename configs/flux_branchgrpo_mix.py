"""FLUX.1-dev with BranchGRPO-Mix, the released script's `MIX_ODE_SDE_TREE=true`: as
flux_branchgrpo.py, but SDE only in a window of 4 steps and ODE elsewhere; the split steps
0, 3, 6 and 9 stay SDE (BranchGRPO's table: 148 s per iteration against DanceGRPO's 698)."""

from configs import flux_branchgrpo


def get_config():
    c = flux_branchgrpo.get_config()
    c.name = "flux_branchgrpo_mix"
    c.tree.method = "branchgrpo_mix"
    c.tree.window = 4
    return c
