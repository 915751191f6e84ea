"""`python -m tree_grpo_jax.rewards.convert`: the converter's command line (`commands.main`)."""

import sys

from tree_grpo_jax import interrupts

if __name__ == "__main__":
    interrupts.install()  # Ctrl-C / SIGTERM: one line, exit 130 / 143; the staged folder goes
    interrupts.set_stop_line(
        lambda name: (
            f"{name} stopped the conversion; nothing was written (the output folder is as it was)."
        )
    )
    if not {"-h", "--help"} & set(sys.argv[1:]):
        print("tree_grpo_jax.rewards.convert: starting...", file=sys.stderr, flush=True)
    from tree_grpo_jax.rewards.convert.commands import main

    sys.exit(main())
