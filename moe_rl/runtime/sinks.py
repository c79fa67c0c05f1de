"""Optional metric sinks of a run: TensorBoard and Weights & Biases (offline), both off by default.

``metrics.jsonl`` is always written; a sink receives the same per-step records (their numeric fields, nested
dicts flattened as ``a/b``). ``MetricSinksConfig`` is the ``metrics`` section of ``RLConfig``
(``--metrics.tensorboard``, ``--metrics.wandb``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_rl.config import BaseConfig

__all__ = ["MetricSinksConfig", "MetricSinks", "numeric_fields"]


class MetricSinksConfig(BaseConfig):
    """Where each step's metrics go besides ``metrics.jsonl`` (every sink off by default)."""

    tensorboard: bool = False
    """Write TensorBoard event files to ``DIR/tensorboard/`` (needs the ``tensorboard`` package; view with
    ``tensorboard --logdir DIR/tensorboard``)."""
    wandb: bool = False
    """Log to Weights & Biases in offline mode under ``DIR/wandb/`` (needs the ``wandb`` package; nothing is sent;
    upload later with ``wandb sync DIR/wandb/offline-run-*``)."""
    wandb_project: str = "moe-rl"
    """The Weights & Biases project name recorded in the offline run."""
    wandb_run_name: str | None = None
    """The Weights & Biases run name (None: the run directory's name)."""


def numeric_fields(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of one metrics record (bools and None skipped; nested dicts flattened as ``a/b``)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(numeric_fields(value, prefix=f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _require(module: str, sink: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0]
        raise ImportError(
            f"metrics.{sink}=true needs the '{package}' package, which is not installed here ({exc}); install it "
            f"with `.venv/bin/pip install {package}` or turn the sink off (--metrics.{sink} false)"
        ) from exc


class MetricSinks:
    """The enabled sinks of one run.

    Args:
        cfg: the ``metrics`` section.
        run_dir: the run directory (``tensorboard/`` and ``wandb/`` are created under it).
        config: the resolved run config as a dict (recorded by Weights & Biases).

    Raises:
        ImportError: a sink is enabled but its package is not installed (the message says how to install it).
    """

    def __init__(self, cfg: MetricSinksConfig, run_dir: Path, config: dict | None = None) -> None:
        self.cfg = cfg
        self._tb = None
        self._wandb = None
        if cfg.tensorboard:
            _require("tensorboard", "tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if cfg.wandb:
            wandb = _require("wandb", "wandb")
            (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or run_dir.name,
                                     dir=str(run_dir), mode="offline", config=config or {})

    @property
    def enabled(self) -> list[str]:
        """The names of the active sinks."""
        return [n for n, s in (("tensorboard", self._tb), ("wandb", self._wandb)) if s is not None]

    def log(self, record: dict[str, Any]) -> None:
        """Send one per-step record (its ``step`` is the x axis)."""
        values = numeric_fields({k: v for k, v in record.items() if k != "step"})
        step = int(record["step"])
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self, exit_code: int = 0) -> None:
        """Flush and close every sink (idempotent)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None
