"""FLUX.1-Kontext-dev editing with TreeGRPO: configs/flux_treegrpo.py's sampler, tree and
optimizer on black-forest-labs/FLUX.1-Kontext-dev, each prompt starting from one input
image, as FluxKontextPipeline's `image=` reference does (its VAE latents follow the noisy
ones as extra image tokens at first id coordinate 1; the transformer's output for them is
dropped).

The embedded guidance is 2.5, the scale Black Forest Labs' model card samples Kontext-dev
with, rather than the pipeline's default 3.5 (FluxPipeline's, which FluxKontextPipeline
inherits): a distilled scale is part of the model being trained, so the run trains the one
users sample with.

The prompts are a file whose rows name the image to edit and the instruction
(docs/models/flux.md, "Editing with FLUX.1-Kontext"), e.g. a .jsonl of

    {"prompt": "make the digit bold", "image": "digits/three.png"}

every image a square of `model.flux.reference_resolution` pixels (0: the output's 720). The
reward is `input_similarity` (minus the mean squared difference of the output and its input
image): it alone favours edits that change little, so weigh it against a reward of the
instruction (`--config.rewards=...`) for real edits.

python -m tree_grpo_jax.main --config=configs/flux_kontext_edit.py \
    --config.model.path=/path/to/FLUX.1-Kontext-dev --config.prompts.source=/path/to/edits.jsonl
"""

from configs import flux_treegrpo


def get_config():
    c = flux_treegrpo.get_config()
    c.name = "flux_kontext_edit"
    c.model.path = "black-forest-labs/FLUX.1-Kontext-dev"
    c.model.flux.guidance = 2.5  # the model card's scale (the pipeline's default is 3.5)
    return editing_settings(c, c.model.flux)


def editing_settings(c, family):
    """One input image a prompt on config `c`, `family` its model's section (`c.model.flux`,
    `c.model.flux2`): the input images as large as the output, an edits file for prompts
    and the input-similarity reward (configs/flux2_klein_edit.py takes them too)."""
    family.reference_images = 1  # each row names one input image
    family.reference_resolution = 0  # the input images are squares of the output's side
    c.prompts.source = "edits.jsonl"  # a prompt file with an image field; replace it
    c.prompts.eval_source = ""
    c.rewards = "input_similarity"
    return c
