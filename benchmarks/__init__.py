"""Benchmarks of the tree engine: cost counts, time per iteration, reward against wall-clock,
the batched engine against a node-at-a-time loop, and the accelerator benchmark of the real
architectures (SD1.5, SD3.5 Medium, FLUX.1-dev).

python -m benchmarks.run --quick     # about 3 minutes on a 2-core CPU
python -m benchmarks.run             # the full CPU suite
python -m benchmarks.accelerator     # every real architecture on this machine's accelerators

Each script writes to `runs/benchmarks/<script>/` (git-ignored) unless `--out` says otherwise;
the committed results in `benchmarks/results/` change only with `--out=benchmarks/results`.
"""
