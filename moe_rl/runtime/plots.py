"""Run curves: reward and mismatch_kl per trainer step (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_curves"]


def plot_curves(records: list[dict], out_path: str | Path) -> Path:
    """Plot ``reward_mean`` and ``mismatch_kl`` against ``step`` into a PNG.

    Args:
        records: metrics records (one per trainer step) with ``step``, ``reward_mean``, ``mismatch_kl``.
        out_path: PNG path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot(steps, [r["reward_mean"] for r in records], lw=1, label="batch reward")
    k = 10
    if len(records) >= k:
        rewards = [r["reward_mean"] for r in records]
        smooth = [sum(rewards[max(0, i - k + 1): i + 1]) / len(rewards[max(0, i - k + 1): i + 1]) for i in range(len(rewards))]
        ax1.plot(steps, smooth, lw=2, label=f"{k}-step mean")
    ax1.set_ylabel("reward")
    ax1.legend(loc="lower right")
    ax1.grid(alpha=0.3)
    # log scale; exact zeros (on-policy steps with identical numerics) are drawn at the floor
    floor = 1e-6
    ax2.plot(steps, [max(r["mismatch_kl"], floor) for r in records], lw=1, color="tab:red")
    ax2.set_yscale("log")
    ax2.set_ylim(bottom=floor)
    ax2.set_ylabel("mismatch_kl (k3)")
    ax2.set_xlabel("trainer step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
