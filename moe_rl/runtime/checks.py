"""Run-config checks shared by the trainer process and the cluster entry points (no process, no I/O)."""

from __future__ import annotations

__all__ = ["UsageError", "check_supported", "check_trainer_supported", "unsupported_weights_kind"]


class UsageError(ValueError):
    """Bad arguments or config (exit status 2)."""


def unsupported_weights_kind(cfg) -> str | None:
    """Why ``weights.kind`` cannot run in the cluster entry points (both refuse it), or None."""
    if cfg.weights.kind == "nccl":
        return ("weights.kind='nccl' is not wired into the cluster entry points yet; set weights.kind="
                "'filesystem' (the trainer publishes weights/step_<v>/ and every engine reloads it)")
    return None


def check_trainer_supported(cfg) -> None:
    """Reject a cluster config the cluster trainer cannot run (it calls this at start-up; so does the dry run).

    Raises:
        ValueError: the recipe's model is described by published figures only (the trainer builds ``glm_moe_dsa``
            and ``glm4_moe`` models), or ``weights.kind`` is not wired into the cluster entry points.
    """
    if not cfg.model.modelled:
        raise ValueError(f"model.architecture={cfg.model.architecture!r} is described by published figures only; the "
                         "trainer builds glm_moe_dsa (GLM-5/5.1) and glm4_moe (GLM-4.5) models")
    problem = unsupported_weights_kind(cfg)
    if problem is not None:
        raise ValueError(problem)


def check_supported(cfg) -> None:
    """Reject settings this entry point cannot run.

    Raises:
        UsageError: ``weights.kind = "nccl"`` (not wired into the cluster entry points: use ``"filesystem"``);
            disaggregated mode with ``orchestrator.off_policy_policy = "mask"`` (needs per-token versions) or with
            ``trainer.router_replay = true`` (needs routing captured by the serving engine); behind the P/D proxy
            the client does not know which replica served a request.
    """
    problems = []
    weights_problem = unsupported_weights_kind(cfg)
    if weights_problem is not None:
        problems.append(weights_problem)
    if cfg.inference.mode == "disaggregated":
        if cfg.orchestrator.off_policy_policy == "mask":
            problems.append(
                "orchestrator.off_policy_policy='mask' with inference.mode='disaggregated': masking by token age "
                "needs per-token policy versions, which cannot be tracked behind the P/D proxy (the client does "
                "not know which decode replica served a request); use off_policy_policy='drop' or 'withhold', or "
                "inference.mode='colocated'")
        if cfg.trainer.router_replay:
            problems.append(
                "trainer.router_replay=true with inference.mode='disaggregated': routed experts are captured by the "
                "serving engine, which is unknown behind the P/D proxy; set trainer.router_replay=false or use "
                "inference.mode='colocated'")
    if problems:
        raise UsageError("; ".join(problems))

