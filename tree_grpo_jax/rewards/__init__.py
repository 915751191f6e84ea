"""Rewards: a registry of functions from decoded images (and prompts) to scores.

Importing this package registers the built-in rewards: `jpeg_compressibility`,
`jpeg_incompressibility` (host, PIL) and the preference models `hpsv2`, `pickscore`,
`aesthetic`, `clip_score` and `imagereward` (JAX-native, each read from its folder:
`load_reward("hpsv2", "/models/hpsv2.1")`). Model families bring the rewards of their own
world on first look-up: the tiny family's `digit_alignment`, `digit_probability`,
`digit_accuracy`, `digit_log_odds` (its digit classifier, in `models/tiny/rewards.py`).
The `remote` family's rewards, `remote:<name>`, are scored by a server over HTTP
(`remote.py`), or by a vision-language judge behind an OpenAI-compatible chat endpoint (`chat.py`).

A new reward is one `register` (or `register_model`, for one that reads a folder, with its
own settings as `options`) in its own module, imported here.

base        a reward (`Reward`), its errors, the weighted sum of several (`CombinedReward`)
registry    the registry, `load_reward`, `load_rewards`, `combined_reward`, the reward
            string's syntax (`parse_rewards`)
families    the `<family>:<instance>` rewards (`remote:<name>`): their settings, checks, probes
jpeg        JPEG (in)compressibility
clip        a frozen CLIP embedding images and prompts (`models.clip`'s Flax towers)
preprocess  the official scorers' image preprocessing, bit-exact, in JAX
preference  the four CLIP-based preference rewards
imagereward ImageReward (BLIP's ViT and cross-attending BERT, an MLP head) in Flax
remote      rewards served over HTTP (`remote:<name>`), the wire format and its client
remote_settings  the settings of a served reward, their bounds and checks
chat        the remote rewards' `chat` protocol: a VLM judge asked a question per image
serve       the reference server: any registered reward or Python callable over HTTP
convert     the pickled HPS-v2.1, aesthetic and ImageReward releases -> folders these load
"""

import sys

from tree_grpo_jax import interrupts

CONVERTER = "tree_grpo_jax.rewards.convert"
SERVER = "tree_grpo_jax.rewards.serve"


def starting_converter() -> None:
    """What `python -m tree_grpo_jax.rewards.convert` does first, as every command does:
    Ctrl-C and SIGTERM taken over (one line, exit 130 / 143, nothing half-written) and a
    line on stderr saying it started."""
    if interrupts.installed():
        return
    interrupts.install()
    interrupts.set_stop_line(
        lambda name: (
            f"{name} stopped the conversion; nothing was written (the output folder is as it was)."
        )
    )
    if not {"-h", "--help"} & set(sys.argv[1:]):
        print(f"{CONVERTER}: starting...", file=sys.stderr, flush=True)


def starting_server() -> None:
    """What `python -m tree_grpo_jax.rewards.serve` does first, as every command does:
    Ctrl-C and SIGTERM taken over, so that one while it loads is one line (exit 130 / 143;
    serving, it lets the requests in flight finish: `serve.serve`), and a line on stderr
    saying it started."""
    if interrupts.installed():
        return
    interrupts.install()
    interrupts.set_stop_line(
        lambda name: f"{name} stopped python -m {SERVER} while it was starting; nothing was served."
    )
    if not {"-h", "--help"} & set(sys.argv[1:]):
        print(f"{SERVER}: starting...", file=sys.stderr, flush=True)


# `python -m` imports the command's parent packages, this one and JAX with it (seconds),
# before the command's own `__main__` runs (sys.argv[0] is "-m" meanwhile): a signal then
# would meet Python's defaults (a KeyboardInterrupt swallowed inside JAX's import, a silent
# death by SIGTERM), so the converter and the server start here.
if sys.argv[:1] == ["-m"] and CONVERTER in getattr(sys, "orig_argv", ()):
    starting_converter()
if sys.argv[:1] == ["-m"] and SERVER in getattr(sys, "orig_argv", ()):
    starting_server()

from tree_grpo_jax.rewards import imagereward, jpeg, preference, remote, similarity  # noqa: E402
from tree_grpo_jax.rewards.base import CombinedReward, Reward  # noqa: E402
from tree_grpo_jax.rewards.registry import (  # noqa: E402
    available_rewards,
    combined_reward,
    get_reward,
    load_reward,
    load_rewards,
    missing_weights,
    needs_weights,
    parse_rewards,
    register,
    register_model,
)

register("jpeg_compressibility", jpeg.jpeg_compressibility, on_host=True)
register("jpeg_incompressibility", jpeg.jpeg_incompressibility, on_host=True)
register("input_similarity", similarity.input_similarity, on_host=True, takes_input_images=True)
preference.register_all()
imagereward.register()
remote.register()

__all__ = [
    "CombinedReward",
    "Reward",
    "available_rewards",
    "combined_reward",
    "get_reward",
    "load_reward",
    "load_rewards",
    "missing_weights",
    "needs_weights",
    "parse_rewards",
    "register",
    "register_model",
]
