"""TreeGRPO's normalised score: how far training moved a reward from the base model towards
the reward's ceiling.

    normalised = (r - r_base) / (r_max - r_base)

r is the checkpoint's mean reward and r_base the base model's, on the same prompts and
noises (`python -m tree_grpo_jax.evaluate --normalised`); r_max is the reward's ceiling as
TreeGRPO states it. 0 is the base, 1 the ceiling, a negative score a reward that fell. Each
reward's r_max is in R_MAX, on this package's scale of the reward: TreeGRPO's 1 for CLIP
score is a cosine, and `clip_score` here is 100 * cosine (torchmetrics' CLIPScore), so 100.
A reward without an r_max (PickScore, the digit and JPEG rewards) has no normalised score.
"""

from __future__ import annotations

# reward name -> r_max, the ceiling TreeGRPO normalises by, in this package's units
R_MAX = {
    "hpsv2": 1.0,  # HPS-v2.1: a cosine
    "imagereward": 2.0,
    "aesthetic": 10.0,  # the LAION aesthetic predictor's 1-10 rating
    "clip_score": 100.0,  # 100 * cosine: TreeGRPO's 1
}


def score(r: float, r_base: float, r_max: float) -> float | None:
    """(r - r_base) / (r_max - r_base); None when the base is already at or above r_max."""
    if r_max <= r_base:
        return None
    return (r - r_base) / (r_max - r_base)


def scores(rows: list[dict], names: list[str]) -> dict:
    """{"r_max": {name: r_max or None}, "rows": {label: {name: score or None}}} for every
    row after the first (the base, `rows[0]`), from each row's `{name: {"mean": ...}}`."""
    base = rows[0]
    r_max = {name: R_MAX.get(name) for name in names}
    out = {}
    for row in rows[1:]:
        out[row["label"]] = {
            name: (
                None
                if r_max[name] is None or name not in row or name not in base
                else score(row[name]["mean"], base[name]["mean"], r_max[name])
            )
            for name in names
        }
    return {"r_max": r_max, "rows": out}


def table(normalised: dict, base_label: str) -> str:
    """The normalised scores (`scores`' result) as a markdown table, r_max stated."""
    names = list(normalised["r_max"])

    def fmt(v):
        return "—" if v is None else f"{v:.4g}"

    head = [
        f"Normalised score (r - r_base) / (r_max - r_base), r_base: {base_label} "
        "(TreeGRPO's table).",
        "",
        "| model | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
        "| r_max | " + " | ".join(fmt(normalised["r_max"][n]) for n in names) + " |",
    ]
    lines = [
        f"| {label} | " + " | ".join(fmt(values[n]) for n in names) + " |"
        for label, values in normalised["rows"].items()
    ]
    return "\n".join(head + lines) + "\n"
