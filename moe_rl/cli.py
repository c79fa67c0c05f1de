"""``moe-rl`` command line.

Usage::

    moe-rl rl @ recipes/debug_cpu/rl.toml --output-dir runs/debug [--max-steps N] [--a.b-c value] [--dry-run]

Config precedence: defaults < ``@`` TOML files (merged left to right) < dotted flags. ``--dry-run`` prints
the resolved config as JSON and exits. An invalid config exits with code 2 before any process starts,
naming each bad field, its value and the rule.
"""

from __future__ import annotations

import sys

__all__ = ["main"]

USAGE = """usage: moe-rl rl @ CONFIG.toml --output-dir DIR [--max-steps N] [--section.field value ...] [--dry-run]

commands:
  rl    run the async RL loop (vLLM server + torchrun trainer + asyncio orchestrator)
"""


HELP_RL = """
config sections (see recipes/debug_cpu/rl.toml and each component's config class for every field):
  output_dir, seed, max_steps, alphabet   run-level settings (moe_rl.entrypoints.rl.RLConfig)
  model.*         GlmMoeConfig             (moe_rl.models)
  task.*          AdditionTaskConfig       (moe_rl.envs)
  sft.*           SftConfig                (moe_rl.trainer)
  inference.*     VllmServerConfig         (moe_rl.inference)
  orchestrator.*  OrchestratorConfig       (moe_rl.rl.orchestrator)
  trainer.*       TrainerConfig            (moe_rl.trainer)
flags use dotted paths, kebab or snake case: --orchestrator.max-off-policy-steps 2
--dry-run prints the resolved config as JSON and exits
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "rl":
        print(f"moe-rl: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    if "-h" in rest or "--help" in rest:
        print(USAGE + HELP_RL)
        return 0
    dry_run = "--dry-run" in rest
    rest = [a for a in rest if a != "--dry-run"]

    from moe_rl.config import ConfigError, load_config
    from moe_rl.entrypoints.rl import RLConfig, RunFailed, run_rl

    try:
        cfg = load_config(RLConfig, rest)
    except ConfigError as exc:
        print(f"moe-rl rl: {exc}", file=sys.stderr)
        return 2
    if dry_run:
        print(cfg.model_dump_json(indent=2))
        return 0
    try:
        summary = run_rl(cfg)
    except RunFailed as exc:
        print(f"moe-rl rl: run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moe-rl rl: interrupted; all started processes were stopped", file=sys.stderr)
        return 130
    print(
        f"moe-rl rl: done: {summary['steps']} steps in {summary['total_wall_s']:.0f}s; reward "
        f"{summary['reward_first5']:.3f} (first 5) -> {summary['reward_last5']:.3f} (last 5); max mismatch_kl "
        f"{summary['mismatch_kl_max']:.2e}; rollouts started {summary['rollouts_started']} = trained "
        f"{summary['rollouts_trained']} + dropped {summary['rollouts_dropped']} + withheld "
        f"{summary.get('rollouts_withheld', 0)} + in flight "
        f"{summary['rollouts_inflight_at_exit']}; outputs in {cfg.output_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
