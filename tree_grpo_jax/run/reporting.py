"""What a user sees and keeps: metric files, a progress line, sample grids and curves.

Samples are images [N, H, W, C] or videos [N, T, H, W, C] in [0, 1]. A video is pictured as
a strip of its frames, left to right, in a PNG, and moving, in an animated GIF beside it.
A video run's reward is also logged frame by frame (`frame_rewards`: one scalar per frame
in metrics.jsonl and TensorBoard, none on the progress line).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import os
import sys
import time

import numpy as np
from PIL import Image


class MetricsWriter:
    """Appends metrics as JSON lines, and to TensorBoard (and wandb) when asked.

    `resume_step`: the run resumes after that step, so rows written for later steps by an
    interrupted process are dropped (JSON lines rewritten, TensorBoard purged) and the
    re-run steps appear once.
    """

    def __init__(
        self,
        workdir: str,
        tensorboard: bool = True,
        wandb_project: str = "",
        resume_step: int | None = None,
    ):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        self._wandb = None
        if resume_step is not None:
            kept = [m for m in read_metrics(workdir) if m.get("step", 0) <= resume_step]
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(m) + "\n" for m in kept)
            os.replace(tmp, self.path)
        if wandb_project:
            try:
                import wandb  # optional; only imported when a project is configured
            except ImportError:
                raise ValueError(
                    f"log.wandb_project is {wandb_project!r} but wandb is not installed; "
                    "pip install wandb, or leave log.wandb_project empty."
                ) from None
            self._wandb = wandb.init(project=wandb_project, dir=workdir)
        if tensorboard:
            from tensorboardX import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=purge)

    def write(self, step: int, metrics: dict, prefix: str = "") -> None:
        scalars = {f"{prefix}{k}": float(v) for k, v in metrics.items() if _is_scalar(v)}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **scalars}) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def write_image(self, step: int, tag: str, images, captions, columns: int) -> None:
        """A grid of `images` with a caption under each, to TensorBoard and wandb (the
        workdir's own pictures are the plain grids); videos as strips of their frames, and
        to TensorBoard also moving (`<tag>_video`) when it can encode them."""
        if self._tb is None and self._wandb is None:
            return
        picture = captioned_grid(as_stills(images), captions, columns)
        if self._tb is not None:
            # tensorboardX encodes a video summary with moviepy, which the package does not
            # depend on: without it the strips' grid below is the videos' only summary
            if is_video(images) and can_write_video():
                frames = np.moveaxis(np.clip(np.asarray(images, np.float32), 0, 1), -1, 2)
                self._tb.add_video(f"{tag}_video", frames, step, fps=1000 / FRAME_MS)
            self._tb.add_image(tag, np.asarray(picture), step, dataformats="HWC")
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Image(picture)}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class NullWriter:
    """A MetricsWriter that writes nothing (the processes that do not log)."""

    def write(self, step: int, metrics: dict, prefix: str = "") -> None:
        del step, metrics, prefix

    def write_image(self, *args) -> None:
        del args

    def close(self) -> None:
        pass


def can_write_video() -> bool:
    """Whether tensorboardX can write video summaries here (moviepy is installed)."""
    return importlib.util.find_spec("moviepy") is not None


FRAME_REWARD = "reward_frame_"  # a video run's per-frame reward: reward_frame_<t>


def frame_rewards(frames) -> dict[str, float]:
    """Per-frame scores [N, T] -> {reward_frame_<t>: the mean over the N videos of frame
    t's score}, t zero-padded so that the names sort in frame order; their mean over t is
    the mean reward. {} for None (images)."""
    if frames is None:
        return {}
    frames = np.asarray(frames, np.float64)
    width = len(str(frames.shape[1] - 1))
    return {f"{FRAME_REWARD}{t:0{width}d}": float(v) for t, v in enumerate(frames.mean(axis=0))}


def is_frame_reward(name: str) -> bool:
    """Whether a metric's name (with or without its `train/` or `eval/`) is a per-frame
    reward, which only metrics.jsonl and TensorBoard show."""
    return name.rpartition("/")[2].startswith(FRAME_REWARD)


def _is_scalar(v) -> bool:
    return np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number)


def read_metrics(workdir: str) -> list[dict]:
    """The rows of metrics.jsonl; a line cut short by a kill is skipped."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def image_grid(images: np.ndarray, columns: int | None = None, scale: int = 1) -> Image.Image:
    """[N, H, W, C] floats in [0, 1] -> one PIL image, `scale` times larger (nearest)."""
    images = np.clip(np.asarray(images, np.float32), 0.0, 1.0)
    n, h, w, c = images.shape
    columns = columns or math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    grid = np.ones((rows * (h + 1) + 1, columns * (w + 1) + 1, c), np.float32)
    for i, img in enumerate(images):
        r, col = divmod(i, columns)
        grid[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + col * (w + 1) : 1 + col * (w + 1) + w] = img
    pixels = (grid * 255).round().astype(np.uint8)
    picture = Image.fromarray(pixels[..., 0] if c == 1 else pixels)
    if scale > 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    return picture


def captioned_grid(images, captions, columns: int, tile: int = 96) -> Image.Image:
    """[N, H, W, C] in [0, 1] as tiles of at least `tile` pixels, each with its caption
    (lines of text) under it; RGB."""
    from PIL import ImageDraw, ImageFont

    images = np.clip(np.asarray(images, np.float32), 0.0, 1.0)
    n, h, w, _ = images.shape
    scale = max(1, -(-tile // max(h, w)))
    font = ImageFont.load_default()
    lines = max(len(str(c).splitlines()) for c in captions) if captions else 0
    text_h = 11 * lines + 4
    cell_w, cell_h = w * scale + 4, h * scale + text_h + 4
    rows = -(-n // columns)
    sheet = Image.new("RGB", (columns * cell_w, rows * cell_h), "white")
    draw = ImageDraw.Draw(sheet)
    limit = max(cell_w // 6, 4)  # characters that fit under a tile
    for i, (image, caption) in enumerate(zip(images, captions)):
        r, col = divmod(i, columns)
        x, y = col * cell_w + 2, r * cell_h + 2
        pixels = (image * 255).round().astype(np.uint8)
        tile_image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
        sheet.paste(tile_image.convert("RGB").resize((w * scale, h * scale), Image.NEAREST), (x, y))
        for j, line in enumerate(str(caption).splitlines()):
            short = line if len(line) <= limit else line[: limit - 1] + "~"
            draw.text((x, y + h * scale + 2 + 11 * j), short, fill="black", font=font)
    return sheet


FRAME_MS = 125  # how long an animated GIF shows each frame (8 frames a second)


def is_video(samples) -> bool:
    """Whether `samples` are videos [N, T, H, W, C] (else images [N, H, W, C])."""
    return np.ndim(samples) == 5


def as_stills(samples) -> np.ndarray:
    """Images unchanged; videos [N, T, H, W, C] -> strips [N, H, T * (W + 1) - 1, C]: each
    video's frames left to right, one white column between two frames (floats in [0, 1],
    or uint8)."""
    samples = np.asarray(samples)
    if not is_video(samples):
        return samples
    n, t, h, w, c = samples.shape
    white = 255 if samples.dtype == np.uint8 else 1.0
    strips = np.full((n, h, t * (w + 1) - 1, c), white, samples.dtype)
    for i in range(t):
        strips[:, :, i * (w + 1) : i * (w + 1) + w] = samples[:, i]
    return strips


def animation_path(path: str) -> str:
    """The animated GIF written beside the PNG `path` of videos."""
    return os.path.splitext(path)[0] + ".gif"


def _save_animation(path: str, frames: list[Image.Image]) -> str:
    frames[0].save(
        path, save_all=True, append_images=frames[1:], duration=FRAME_MS, loop=0, optimize=False
    )
    return path


def _grid_scale(samples) -> int:
    height = np.shape(samples)[2 if is_video(samples) else 1]
    return max(1, 256 // max(height * 8, 1))


def save_grid(path: str, images: np.ndarray, columns: int | None = None) -> str:
    """The samples' grid as the PNG `path`; for videos, each cell is a video's strip of
    frames and the grid also moves, frame by frame, in `animation_path(path)`."""
    scale = _grid_scale(images)
    image_grid(as_stills(images), columns, scale=scale).save(path)
    if is_video(images):
        frames = np.swapaxes(np.asarray(images), 0, 1)  # [T, N, H, W, C]
        _save_animation(animation_path(path), [image_grid(f, columns, scale) for f in frames])
    return path


def save_sample(path: str, sample) -> list[str]:
    """One sample in [0, 1] (or uint8): an image [H, W, C] as the PNG `path`; a video
    [T, H, W, C] as its strip of frames there and the animated GIF `animation_path(path)`.
    Returns the files written."""
    sample = np.asarray(sample)
    if sample.dtype != np.uint8:
        sample = (np.clip(sample.astype(np.float32), 0.0, 1.0) * 255).round().astype(np.uint8)

    def picture(pixels):
        return Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)

    if sample.ndim == 3:
        picture(sample).save(path)
        return [path]
    picture(as_stills(sample[None])[0]).save(path)
    return [path, _save_animation(animation_path(path), [picture(f) for f in sample])]


CURVE_SIZE = (600, 384)  # pixels
CURVE_COLOR = (31, 119, 180)  # the line and its markers
_CURVE_MARGINS = (78, 34, 18, 50)  # left, top, right, bottom: the axes' labels and the title
_CURVE_SUPERSAMPLING = 2  # drawn larger, then scaled down: smooth lines and markers


def nice_ticks(low: float, high: float, count: int = 6, integer: bool = False) -> np.ndarray:
    """Round values, 1, 2 or 5 times a power of ten apart, from at or below `low` to at or
    above `high` in about `count` steps (whole numbers at least 1 apart when `integer`)."""
    raw = (high - low) / max(count, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    if integer:
        step = max(step, 1.0)
    first = math.floor(low / step + 1e-9) * step
    return first + step * np.arange(int(math.ceil((high - first) / step - 1e-9)) + 1)


def _tick_label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    text = f"{value:.{decimals}f}"
    return "0" if float(text) == 0 else text


def _padded(low: float, high: float) -> tuple[float, float]:
    """A range around [low, high] that keeps the extreme points off the axes' edges."""
    span = high - low
    pad = 0.05 * span if span > 0 else max(abs(low) * 0.1, 1.0)
    return low - pad, high + pad


def save_curve(path: str, steps, values, ylabel: str, title: str) -> str:
    """A line plot of `values` over `steps` (iterations) as the PNG `path`: axes with round
    ticks and a light grid, the points marked, the title above. Drawn with PIL (a plotting
    library would add a second or two to the command's imports)."""
    from PIL import ImageDraw, ImageFont

    k = _CURVE_SUPERSAMPLING
    steps = np.asarray(steps, np.float64)
    values = np.asarray(values, np.float64)
    width, height = CURVE_SIZE[0] * k, CURVE_SIZE[1] * k
    left, top, right, bottom = (m * k for m in _CURVE_MARGINS)
    x0, y0, x1, y1 = left, top, width - right, height - bottom  # the axes' box
    x_low, x_high = _padded(float(steps.min()), float(steps.max()))
    y_low, y_high = _padded(float(values.min()), float(values.max()))
    x_ticks = [t for t in nice_ticks(x_low, x_high, integer=True) if x_low <= t <= x_high]
    y_all = nice_ticks(y_low, y_high)
    y_ticks = [t for t in y_all if y_low <= t <= y_high]
    y_step = float(y_all[1] - y_all[0]) if len(y_all) > 1 else 1.0

    def at(step, value):
        x = x0 + (step - x_low) / (x_high - x_low) * (x1 - x0)
        y = y1 - (value - y_low) / (y_high - y_low) * (y1 - y0)
        return x, y

    font = ImageFont.load_default(size=13 * k)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    grid, ink = (222, 222, 222), (40, 40, 40)
    for t in x_ticks:
        x = at(t, y_low)[0]
        draw.line([(x, y0), (x, y1)], fill=grid, width=k)
        draw.line([(x, y1), (x, y1 + 4 * k)], fill=ink, width=k)
        draw.text((x, y1 + 6 * k), f"{t:.0f}", fill=ink, font=font, anchor="mt")
    for t in y_ticks:
        y = at(x_low, t)[1]
        draw.line([(x0, y), (x1, y)], fill=grid, width=k)
        draw.line([(x0 - 4 * k, y), (x0, y)], fill=ink, width=k)
        draw.text((x0 - 6 * k, y), _tick_label(t, y_step), fill=ink, font=font, anchor="rm")
    draw.rectangle([x0, y0, x1, y1], outline=ink, width=k)
    points = [at(s, v) for s, v in zip(steps, values)]
    if len(points) > 1:
        draw.line(points, fill=CURVE_COLOR, width=2 * k, joint="curve")
    for x, y in points:
        draw.ellipse([x - 3 * k, y - 3 * k, x + 3 * k, y + 3 * k], fill=CURVE_COLOR)
    draw.text(((x0 + x1) / 2, height - 6 * k), "iteration", fill=ink, font=font, anchor="md")
    title_font = ImageFont.load_default(size=15 * k)
    draw.text(((x0 + x1) / 2, y0 - 8 * k), title, fill=ink, font=title_font, anchor="md")
    label = Image.new("RGB", (int(draw.textlength(ylabel, font=font)) + 4 * k, 18 * k), "white")
    ImageDraw.Draw(label).text((2 * k, 9 * k), ylabel, fill=ink, font=font, anchor="lm")
    label = label.rotate(90, expand=True)
    image.paste(label, (6 * k, (y0 + y1 - label.height) // 2))
    image.resize(CURVE_SIZE, Image.Resampling.LANCZOS).save(path)
    return path


class Progress:
    """One line per iteration with the key metrics, elapsed time and ETA."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.total, self.start, self.enabled = total, start, enabled
        self.t0 = time.time()
        self.times: list[float] = []

    def update(self, iteration: int, seconds: float, metrics: dict) -> str:
        self.times.append(seconds)
        # The first iteration pays for compilation; the ETA uses the later ones when it can.
        steady = self.times[1:]
        eta = _clock((self.total - iteration - 1) * float(np.median(steady))) if steady else "-:--"
        fields = " ".join(f"{k}={_fmt(metrics[k])}" for k in metrics)
        line = (
            f"[{iteration + 1:>4}/{self.total}] {seconds:6.2f}s/it "
            f"elapsed {_clock(time.time() - self.t0)} eta {eta} | {fields}"
        )
        if self.enabled:
            print(line, flush=True)
        return line


def _fmt(v) -> str:
    v = float(v)
    return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 60:d}:{seconds % 60:02d}"


class _SurvivingStream:
    """A text stream whose writes never raise when the reader has gone (`| tee log` closed
    by Ctrl-C, a closed terminal): the run then goes on, and saves, without its output."""

    def __init__(self, stream):
        self._stream = stream
        self.closed_reader = False

    def _guarded(self, method, *args):
        if self.closed_reader:
            return None
        try:
            return getattr(self._stream, method)(*args)
        except (BrokenPipeError, ConnectionResetError, ValueError):
            pass  # ValueError: the stream object itself was closed
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.EIO):
                raise
        self._drop()
        return None

    def _drop(self) -> None:
        """From now on the stream's output goes nowhere, also what Python flushes at exit."""
        self.closed_reader = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass  # not a file descriptor (a test's StringIO): dropping the writes is enough

    def write(self, text):
        written = self._guarded("write", text)
        return len(text) if written is None else written

    def flush(self):
        self._guarded("flush")

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_closed_streams() -> None:
    """Makes stdout and stderr survive a reader that has gone away (see _SurvivingStream)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _SurvivingStream):
            setattr(sys, name, _SurvivingStream(stream))
