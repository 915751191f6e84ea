"""FLUX.2-klein editing with TreeGRPO: configs/flux2_klein_treegrpo.py's model, sampler, tree
and optimizer, each prompt starting from one input image, as Flux2KleinPipeline's `image=`
reference does (its VAE latents sit beside the noisy ones as extra image tokens, at time
10; the transformer's output for them is dropped).

The editing settings are configs/flux_kontext_edit.py's `editing_settings`. The prompts
are a file whose rows name the image to edit and the instruction
(docs/models/flux2.md, "Editing"), e.g. a .jsonl of

    {"prompt": "make the digit bold", "image": "digits/three.png"}

every image a square of `model.flux2.reference_resolution` pixels (0: the output's 384).
The reward is `input_similarity` (minus the mean squared difference of the output and its
input image): it alone favours edits that change little, so weigh it against a reward of
the instruction (`--config.rewards=...`) for real edits.

python -m tree_grpo_jax.main --config=configs/flux2_klein_edit.py \
    --config.model.path=/path/to/FLUX.2-klein-4B --config.prompts.source=/path/to/edits.jsonl
"""

from configs import flux2_klein_treegrpo, flux_kontext_edit


def get_config():
    c = flux2_klein_treegrpo.get_config()
    c.name = "flux2_klein_edit"
    return flux_kontext_edit.editing_settings(c, c.model.flux2)
