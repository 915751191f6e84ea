"""Benchmarks of the tree engine: cost counts, time per iteration, reward against wall-clock,
the batched engine against a node-at-a-time loop, and an SD1.5-sized GPU script.

python -m benchmarks.run --quick     # about 3 minutes on a 2-core CPU
python -m benchmarks.run             # the full CPU suite
python -m benchmarks.gpu_sd15        # SD1.5 UNet on one GPU
"""
