"""BranchGRPO-Mix on the tiny digits model: SDE only in a window of 4 steps at step 0, with
its four BRANCH(2) splits inside the window (16 leaves), depth-wise advantages.

Splits inside the window train as many window edges as TreeGRPO's tree. With the spacing of
tiny_branchgrpo.py (0, 2, 4, 6), two of the four splits fall on low-noise steps outside the
window: that needed 2.9x the images to the halfway reward on digit_alignment and 1.1x on
jpeg_compressibility (BENCHMARKS.md, section 9). It trains as tiny.py does (one update per
iteration at the learning rate of 2e-4); so trained, it needed 267 images to grpo's final
jpeg_compressibility reward, against 286 for treegrpo and 357 for mixgrpo at the same rate.
"""

from configs import tiny


def get_config():
    c = tiny.get_config()
    c.name = "tiny_branchgrpo_mix"
    c.tree.method = "branchgrpo_mix"
    c.tree.window = 4
    c.tree.split_steps = (0, 1, 2, 3)
    c.tree.k = 2
    return c
