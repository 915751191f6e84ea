"""Trains the tiny text-to-image twins and the digit classifier, and evaluates them.

    python -m tree_grpo_jax.models.tiny.train --kind=all          # classifier, ddim, flow
    python -m tree_grpo_jax.models.tiny.train --kind=ddim
    python -m tree_grpo_jax.models.tiny.train --evaluate          # figures of shipped weights

Every run is deterministic (fixed seeds, fixed data split) and writes its weights into
`runs/tiny_weights/` (git-ignored, under the working directory), or `--out-dir`:
`--out-dir=tree_grpo_jax/assets` replaces the weights the package ships. The diffusion twins
train their UNet and their text encoder together, with the prompt dropped to "" 10% of the
time for classifier-free guidance.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tree_grpo_jax.core import sampling
from tree_grpo_jax.models.base import Sampling
from tree_grpo_jax.models.tiny import classifier, grammar, networks, tokenizer
from tree_grpo_jax.models.tiny.data import digits_dataset
from tree_grpo_jax.models.tiny.model import load_tiny
from tree_grpo_jax.models.tiny.weights import ASSETS_DIR, save_weights, weights_path

DEFAULT_STEPS = {"classifier": 1500, "ddim": 1000, "flow": 1000}
SEEDS = {"classifier": 1, "ddim": 2, "flow": 3}
PROMPT_DROP = 0.1  # "" for classifier-free guidance
STYLE_PROB = 0.5  # of the rest: a thin/thick prompt where the image is one
EMA_DECAY = 0.999
LOG_EVERY = 100
DEFAULT_OUT_DIR = "runs/tiny_weights"  # the shipped weights change only with --out-dir


# ---------------------------------------------------------------------------------------------
# Prompts of the training images.


def ink_styles(images: np.ndarray, labels: np.ndarray) -> list[str | None]:
    """'thin' / 'thick' for the lightest / heaviest third of each digit's ink mass, else None.

    Ranking within a digit keeps the words about the stroke, not about which digit has the
    most ink (an eight always has more than a one).
    """
    mass = images.reshape(len(images), -1).sum(-1)
    styles: list[str | None] = [None] * len(images)
    for digit in range(10):
        idx = np.flatnonzero(labels == digit)
        low, high = np.quantile(mass[idx], [1 / 3, 2 / 3])
        for i in idx:
            styles[i] = "thin" if mass[i] <= low else "thick" if mass[i] > high else None
    return styles


def prompt_tokens(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per image three prompts, `[N, 3, L]` ids and masks: "", the plain one, the styled one
    (the plain one again where the image is neither thin nor thick)."""
    styles = ink_styles(images, labels)
    prompts = []
    for label, style in zip(labels, styles):
        prompts += ["", grammar.digit_prompt(int(label)), grammar.digit_prompt(int(label), style)]
    ids, mask = tokenizer.tokenize(prompts)
    return ids.reshape(len(images), 3, -1), mask.reshape(len(images), 3, -1)


def choose_prompts(key, ids, mask):
    """Picks "" with probability PROMPT_DROP, else styled with STYLE_PROB, else plain."""
    u = jax.random.uniform(key, (ids.shape[0],))
    choice = jnp.where(
        u < PROMPT_DROP, 0, jnp.where(u < PROMPT_DROP + (1 - PROMPT_DROP) * STYLE_PROB, 2, 1)
    )
    pick = lambda a: jnp.take_along_axis(a, choice[:, None, None], axis=1)[:, 0]
    return pick(ids), pick(mask)


# ---------------------------------------------------------------------------------------------
# Diffusion and flow training.


def noisy_input(kind: str, key, x0):
    """The training pair of one batch: (x_t, model timestep, regression target)."""
    t_key, noise_key = jax.random.split(key)
    noise = jax.random.normal(noise_key, x0.shape)
    batch = x0.shape[0]
    if kind == "ddim":
        alphas_cumprod = jnp.asarray(sampling.scaled_linear_alphas_cumprod(), jnp.float32)
        t = jax.random.randint(t_key, (batch,), 0, alphas_cumprod.shape[0])
        a = alphas_cumprod[t][:, None, None, None]
        return jnp.sqrt(a) * x0 + jnp.sqrt(1.0 - a) * noise, t, noise
    # Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, velocity noise - x0, t = 1000 sigma.
    sigma = jax.random.uniform(t_key, (batch,))
    s = sigma[:, None, None, None]
    return (1.0 - s) * x0 + s * noise, sigma * 1000.0, noise - x0


def diffusion_loss(weights, kind, key, images, ids, mask):
    prompt_key, noise_key = jax.random.split(key)
    ids, mask = choose_prompts(prompt_key, ids, mask)
    cond = networks.encode_tokens(weights["text_encoder"], ids, mask)
    x0 = jnp.transpose(images, (0, 3, 1, 2)) * 2.0 - 1.0  # [0, 1] NHWC -> [-1, 1] NCHW
    x_t, t, target = noisy_input(kind, noise_key, x0)
    prediction = networks.make_unet().apply({"params": weights["unet"]}, x_t, t, cond).sample
    return jnp.mean((prediction - target) ** 2)


def make_optimizer(steps: int, peak_lr: float) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, min(100, steps // 10), steps)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))


def sample_batch(key, n: int, batch_size: int):
    return jax.random.randint(key, (batch_size,), 0, n)


def train_diffusion(kind: str, steps: int, batch_size: int, seed: int, lr: float = 1e-3):
    """Returns the EMA weights `{"unet", "text_encoder"}` after `steps` Adam steps."""
    images, labels = digits_dataset("train")
    ids, mask = prompt_tokens(images, labels)
    images, ids, mask = jnp.asarray(images), jnp.asarray(ids), jnp.asarray(mask)
    init_key, loop_key = jax.random.split(jax.random.key(seed))
    weights = jax.jit(networks.init_weights)(init_key)
    optimizer = make_optimizer(steps, lr)
    state = (weights, optimizer.init(weights), weights)

    @jax.jit
    def step(state, key, step_index):
        weights, opt_state, ema = state
        batch_key, loss_key = jax.random.split(key)
        idx = sample_batch(batch_key, images.shape[0], batch_size)
        loss, grads = jax.value_and_grad(diffusion_loss)(
            weights, kind, loss_key, images[idx], ids[idx], mask[idx]
        )
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        weights = optax.apply_updates(weights, updates)
        # EMA with a short warm-up, so early steps do not pin it to the random init.
        decay = jnp.minimum(EMA_DECAY, (1.0 + step_index) / (10.0 + step_index))
        ema = jax.tree.map(lambda e, w: decay * e + (1.0 - decay) * w, ema, weights)
        return (weights, opt_state, ema), loss

    return _run_loop(f"tiny-{kind}", step, state, loop_key, steps)[2]


def _run_loop(name, step, state, key, steps):
    start, losses = time.perf_counter(), []
    for i in range(steps):
        state, loss = step(state, jax.random.fold_in(key, i), jnp.asarray(i, jnp.float32))
        losses.append(loss)
        if (i + 1) % LOG_EVERY == 0 or i + 1 == steps:
            mean_loss = float(jnp.mean(jnp.stack(losses)))
            elapsed = time.perf_counter() - start
            print(
                f"[{name}] step {i + 1}/{steps}  loss {mean_loss:.4f}  {elapsed:.0f} s", flush=True
            )
            losses = []
    return state


# ---------------------------------------------------------------------------------------------
# Classifier.


def augment(key, images):
    """A random shift of up to one pixel and a little pixel noise, so that the classifier
    also scores the slightly imperfect digits a sampler makes."""
    shift_key, noise_key = jax.random.split(key)
    padded = jnp.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)))
    offsets = jax.random.randint(shift_key, (images.shape[0], 2), 0, 3)
    crop = lambda im, o: jax.lax.dynamic_slice(im, (o[0], o[1], 0), (8, 8, 1))
    shifted = jax.vmap(crop)(padded, offsets)
    noisy = shifted + 0.05 * jax.random.normal(noise_key, shifted.shape)
    return jnp.clip(noisy, 0.0, 1.0)


def train_classifier(steps: int, batch_size: int, seed: int, lr: float = 1e-3):
    images, labels = map(jnp.asarray, digits_dataset("train"))
    init_key, loop_key = jax.random.split(jax.random.key(seed))
    model = classifier.DigitClassifier()
    params = model.init(init_key, images[:1])["params"]
    optimizer = make_optimizer(steps, lr)

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(state, key, step_index):
        params, opt_state = state
        batch_key, aug_key = jax.random.split(key)
        idx = sample_batch(batch_key, images.shape[0], batch_size)
        loss, grads = jax.value_and_grad(loss_fn)(
            params, augment(aug_key, images[idx]), labels[idx]
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    params, _ = _run_loop("classifier", step, (params, optimizer.init(params)), loop_key, steps)
    return params


def classifier_accuracy(params, split: str = "test") -> float:
    images, labels = digits_dataset(split)
    log_probs = classifier.classifier_log_probs(params, jnp.asarray(images))
    return float(np.mean(np.asarray(jnp.argmax(log_probs, -1)) == labels))


# ---------------------------------------------------------------------------------------------
# Evaluation: sample, classify, count.


@functools.partial(jax.jit, static_argnames=("denoise", "stochastic"))
def _sample(denoise, params, schedule, cond, uncond, guidance, key, *, stochastic: bool):
    """Classifier-free-guided sampling over the whole schedule; returns pixel-space x_0."""
    batch = cond.shape[0]
    x_key, step_key = jax.random.split(key)
    x = jax.random.normal(x_key, (batch, *networks.SAMPLE_SHAPE))
    both_cond = jnp.concatenate([cond, jnp.broadcast_to(uncond, cond.shape)])

    def body(x, i):
        t = jnp.broadcast_to(schedule.timesteps[i], (2 * batch,))
        pred_c, pred_u = jnp.split(denoise(params, jnp.concatenate([x, x]), t, both_cond), 2)
        prediction = pred_u + guidance * (pred_c - pred_u)
        if not stochastic:
            return schedule.deterministic_step(i, x, prediction), None
        mean, std = schedule.transition(i, x, prediction)
        noise = jax.random.normal(jax.random.fold_in(step_key, i), x.shape)
        return mean + std * noise, None

    x, _ = jax.lax.scan(body, x, jnp.arange(schedule.num_steps))
    return x


def generate(model, prompts, key, *, num_steps: int, guidance: float, eta: float = 0.0):
    """Images `[B, 8, 8, 1]` for `prompts`. `eta` is DDIM's eta, or the flow SDE's noise
    level a; 0 samples deterministically (DDIM eta 0, flow ODE)."""
    schedule = model.make_schedule(num_steps, Sampling(eta=eta, noise_level=eta))
    cond = model.encode_prompts(prompts)
    uncond = model.encode_prompts([""])
    guidance = jnp.float32(guidance)
    x = _sample(
        model.denoise, model.params, schedule, cond, uncond, guidance, key, stochastic=eta > 0
    )
    return model.decode(x)


def prompted_log_probs(images, prompts) -> tuple[jax.Array, np.ndarray]:
    """The shipped classifier's `[B, 10]` log-probabilities and the prompted digits `[B]`."""
    labels = np.asarray([grammar.prompt_digit(p) for p in prompts], np.int32)
    return classifier.digit_log_probs(images), labels


def digit_alignment(images, prompts) -> float:
    """The mean digit_alignment reward: log p(prompted digit | image)."""
    log_probs, labels = prompted_log_probs(images, prompts)
    return float(jnp.mean(jnp.take_along_axis(log_probs, jnp.asarray(labels)[:, None], -1)[:, 0]))


def per_digit_accuracy(images, prompts) -> np.ndarray:
    log_probs, labels = prompted_log_probs(images, prompts)
    hits = (np.asarray(jnp.argmax(log_probs, axis=-1)) == labels).astype(np.float32)
    return np.array([hits[labels == d].mean() for d in range(10)])


def save_grid(images, path, rows: int, scale: int = 6) -> None:
    """Writes `[rows * cols, H, W, 1]` images as a PNG grid, one grey pixel between cells."""
    from PIL import Image

    images = np.pad(np.asarray(images)[..., 0], ((0, 0), (0, 1), (0, 1)), constant_values=0.5)
    n, h, w = images.shape
    cols = n // rows
    grid = images[: rows * cols].reshape(rows, cols, h, w).transpose(0, 2, 1, 3)
    grid = (grid.reshape(rows * h, cols * w) * 255).round().astype(np.uint8)
    Image.fromarray(grid).resize((cols * w * scale, rows * h * scale), Image.NEAREST).save(path)


EVAL_SETTINGS = {  # (steps, guidance, eta or flow noise level); the first is the headline
    "ddim": [(20, 3.0, 0.0), (10, 3.0, 0.0), (20, 1.0, 0.0), (20, 5.0, 0.0), (20, 3.0, 1.0),
             (50, 3.0, 1.0), (20, 1.0, 1.0)],
    "flow": [(20, 3.0, 0.0), (10, 3.0, 0.0), (20, 1.0, 0.0), (20, 5.0, 0.0), (20, 3.0, 0.7),
             (20, 1.0, 0.7)],
}  # fmt: skip


def evaluate(kind: str, per_digit: int, seed: int = 0, grid_dir=None) -> None:
    """Prints, per sampler setting, the classifier accuracy (overall and per digit) and the
    mean digit_alignment reward of `per_digit` samples of each digit prompt; then the ink mass
    of plain, thin and thick prompts under the headline setting."""
    model = load_tiny(kind)
    prompts = [p for p in grammar.DIGIT_PROMPTS for _ in range(per_digit)]
    for num_steps, guidance, eta in EVAL_SETTINGS[kind]:
        start = time.perf_counter()
        key = jax.random.key(seed)
        images = generate(model, prompts, key, num_steps=num_steps, guidance=guidance, eta=eta)
        acc = per_digit_accuracy(images, prompts)
        alignment = digit_alignment(images, prompts)
        noise = f"eta={eta}" if kind == "ddim" else (f"sde a={eta}" if eta else "ode")
        label = f"{kind} steps={num_steps} cfg={guidance} {noise}"
        per = " ".join(f"{a:.2f}" for a in acc)
        elapsed = time.perf_counter() - start
        print(
            f"[eval] {label}: accuracy {acc.mean():.3f} alignment {alignment:.3f} "
            f"per digit [{per}] ({elapsed:.1f} s)",
            flush=True,
        )
        if grid_dir is not None:
            keep = np.concatenate([np.arange(d * per_digit, d * per_digit + 8) for d in range(10)])
            name = f"{kind}_s{num_steps}_cfg{guidance}_eta{eta}.png"
            save_grid(np.asarray(images)[keep], pathlib.Path(grid_dir) / name, rows=10)
    # Style words: a thick prompt should ink more than a thin one (ink = sum of pixels).
    data_ink = digits_dataset("test")[0].sum(axis=(1, 2, 3)).mean()
    print(f"[eval] held-out data: mean ink {data_ink:.2f}")
    num_steps, guidance, eta = EVAL_SETTINGS[kind][0]
    for style in (None, *grammar.STYLE_WORDS):
        style_prompts = [
            grammar.digit_prompt(d, style) for d in range(10) for _ in range(per_digit)
        ]
        key = jax.random.key(seed + 1)
        images = generate(
            model, style_prompts, key, num_steps=num_steps, guidance=guidance, eta=eta
        )
        ink = float(jnp.mean(jnp.sum(images, axis=(1, 2, 3))))
        acc = per_digit_accuracy(images, style_prompts).mean()
        print(f"[eval] {kind} style={style}: mean ink {ink:.2f}  accuracy {acc:.3f}", flush=True)


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="all", choices=("all", "classifier", "ddim", "flow"))
    parser.add_argument("--steps", type=int, default=None, help="default: per kind")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--out-dir",
        default=DEFAULT_OUT_DIR,
        help=f"where the weights go (default {DEFAULT_OUT_DIR}; {ASSETS_DIR} replaces the "
        "shipped ones)",
    )
    parser.add_argument("--evaluate", action="store_true", help="evaluate instead of training")
    parser.add_argument("--per-digit", type=int, default=50, help="samples per digit (evaluate)")
    parser.add_argument("--grid-dir", default=None, help="write sample grids here (evaluate)")
    args = parser.parse_args(argv)
    kinds = ("classifier", "ddim", "flow") if args.kind == "all" else (args.kind,)
    out_dir = pathlib.Path(args.out_dir)

    if args.evaluate:
        for kind in kinds:
            if kind == "classifier":
                params = classifier.load_classifier()
                print(f"[eval] classifier held-out accuracy {classifier_accuracy(params):.4f}")
                continue
            evaluate(kind, args.per_digit, grid_dir=args.grid_dir)
        return

    out_dir.mkdir(parents=True, exist_ok=True)
    for kind in kinds:
        steps = args.steps or DEFAULT_STEPS[kind]
        start = time.perf_counter()
        if kind == "classifier":
            params = train_classifier(steps, args.batch_size, SEEDS[kind])
            path = out_dir / classifier.CLASSIFIER_PATH.name
            classifier.save_classifier(path, params)
            print(f"[classifier] held-out accuracy {classifier_accuracy(params):.4f}")
        else:
            weights = train_diffusion(kind, steps, args.batch_size, SEEDS[kind])
            path = out_dir / weights_path(kind).name
            save_weights(path, weights, kind)
        elapsed = time.perf_counter() - start
        print(f"[{kind}] wrote {path} ({path.stat().st_size / 1e6:.2f} MB) in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
