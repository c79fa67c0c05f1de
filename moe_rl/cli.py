"""``moe-rl`` command line.

Usage::

    moe-rl rl @ recipes/debug_cpu/rl.toml --output-dir runs/debug [--max-steps N] [--a.b-c value] [--dry-run]
              [--overwrite | --resume]
    moe-rl rl --help [SECTION]     (every field of SECTION, e.g. trainer or trainer.optim: type, default, doc)
    moe-rl --version
    moe-rl cluster @ recipes/glm5_1/rl.toml [--a.b-c value] [--dry-run] [--out DIR]

Config precedence: defaults < ``@`` TOML files (merged left to right) < dotted flags. ``--dry-run`` prints
the resolved config as JSON and exits. An invalid config exits with code 2 before any process starts,
naming each bad field, its value and the rule.
"""

from __future__ import annotations

import os
import sys

__all__ = ["main"]

USAGE = """usage: moe-rl rl @ CONFIG.toml --output-dir DIR [--max-steps N] [--section.field value ...] [--dry-run]
                 [--overwrite | --resume]
       moe-rl rl --help [SECTION | all]
       moe-rl cluster @ CONFIG.toml [--section.field value ...] [--dry-run] [--out DIR]

commands:
  rl       run the async RL loop (vLLM server + torchrun trainer + asyncio orchestrator)
  cluster  plan a Slurm GPU run (trainer, P/D vLLM engines, Mooncake, router, orchestrator): check it and write
           its sbatch script (recipes/glm5_1/rl.toml)
  --version  print the package version
"""


HELP_RL = """
config sections (moe-rl rl --help SECTION lists each field of a section with its type, default and doc;
moe-rl rl --help all lists every field):
  output_dir, seed, max_steps, alphabet   run-level settings (moe_rl.runtime.config.RLConfig)
  model.*         GlmMoeConfig             (moe_rl.models)
  task.*          AdditionTaskConfig, or ChainedAdditionTaskConfig with --task.num-turns N (moe_rl.envs)
  env, env_args.* an environment "package.module:factory" called as factory(tokenizer, **env_args), instead of
                  the built-in task (recipes/agentic_cpu/rl.toml; docs/environments.md)
  sft.*           SftConfig                (moe_rl.runtime.trainer)
  inference.*     VllmServerConfig         (moe_rl.inference)
  orchestrator.*  OrchestratorConfig       (moe_rl.runtime.orchestrator)
  trainer.*       TrainerConfig            (moe_rl.runtime.trainer)
  metrics.*       MetricSinksConfig        (moe_rl.runtime.sinks: TensorBoard, Weights & Biases offline; off)
flags use dotted paths, kebab or snake case: --orchestrator.max-off-policy-steps 2
--dry-run    prints the resolved config as JSON and exits
--overwrite  an --output-dir that holds an earlier run (finished or failed) is refused without it (nothing is
             deleted); with it, that run's files are deleted first (the cached SFT warm-up in sft/ is kept)
--resume     continue the run in --output-dir from its newest complete checkpoint (checkpoints/step_<n>, written
             every trainer.checkpoint_every steps and after the last one) up to --max-steps: the engines load
             version n first, versions continue at n + 1, metrics.jsonl and the accounting continue; refused (exit 2)
             without a complete checkpoint or when the config differs in a field that must match (each named)
exit codes: 0 done, 1 the run failed, 2 invalid config or refused output directory, 130 interrupted (Ctrl-C or
SIGTERM); every run that started writes summary.json (its "exit": status, cause, code) and curves.png
"""


def _version() -> str:
    from moe_rl import __version__

    return f"moe-rl {__version__}"


def _rl_help(rest: list[str]) -> int:
    """``moe-rl rl --help [SECTION]``: the sections, or every field of one section (or ``all``)."""
    flag = next(i for i, a in enumerate(rest) if a in ("-h", "--help"))
    section = rest[flag + 1] if flag + 1 < len(rest) and not rest[flag + 1].startswith(("-", "@")) else None
    if section is None:
        print(USAGE + HELP_RL)
        return 0
    from moe_rl.config import describe_config
    from moe_rl.runtime.config import RLConfig

    try:
        text = describe_config(RLConfig, None if section == "all" else section)
    except ValueError as exc:
        print(f"moe-rl rl --help: {exc}", file=sys.stderr)
        return 2
    title = "every field" if section == "all" else f"section {section}"
    print(f"moe-rl rl: {title} (flag: type = default of moe-rl rl (constraints), then the field's doc; a recipe "
          "given with @ may set other values: see --dry-run)\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``moe-rl`` console entry point (returns the exit code). A closed stdout (``moe-rl ... | head``) ends
    the command quietly instead of with a ``BrokenPipeError`` traceback."""
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the reader went away: send what remains to /dev/null so the interpreter's final flush does not fail too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        print(_version())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "cluster":
        return _cluster(rest)
    if command != "rl":
        print(f"moe-rl: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    if "-h" in rest or "--help" in rest:
        return _rl_help(rest)
    if "--version" in rest:
        print(_version())
        return 0
    dry_run = "--dry-run" in rest
    overwrite = "--overwrite" in rest
    resume = "--resume" in rest
    if resume and overwrite:
        print("moe-rl rl: --resume and --overwrite exclude each other (--resume continues the run in --output-dir, "
              "--overwrite deletes it first); give one of them", file=sys.stderr)
        return 2
    rest = [a for a in rest if a not in ("--dry-run", "--overwrite", "--resume")]

    from moe_rl.config import ConfigError, load_config
    from moe_rl.entrypoints.rl import RunDirInUse, RunFailed, run_rl
    from moe_rl.runtime.config import RLConfig

    try:
        cfg = load_config(RLConfig, rest)
    except ConfigError as exc:
        print(f"moe-rl rl: {exc}", file=sys.stderr)
        return 2
    if dry_run:
        print(cfg.model_dump_json(indent=2))
        return 0
    try:
        summary = run_rl(cfg, existing="overwrite" if overwrite else "resume" if resume else "refuse")
    except RunDirInUse as exc:
        print(f"moe-rl rl: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"moe-rl rl: run failed: {exc}\nmoe-rl rl: summary.json and curves.png are in {cfg.output_dir}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"moe-rl rl: interrupted; all started processes were stopped; summary.json and curves.png are in "
              f"{cfg.output_dir}", file=sys.stderr)
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


HELP_CLUSTER = """
moe-rl cluster @ CONFIG.toml [--section.field value ...] [--dry-run] [--out DIR]

  --dry-run   print the verdict first (OK / FAIL: reason), then every process's command (repeated ones condensed),
              the trainer's memory plan (a row per phase, with its margin), the inference memory plan and the
              resolved config; exit 1 when the trainer cannot build the model, an entry point refuses the config, a
              plan does not fit (the message lists complete sets of flags that fit, each checked) or the decode
              concurrency exceeds the KV plan; 2 on an invalid config
  --out DIR   write DIR/job.sbatch (submit it with `sbatch DIR/job.sbatch`), DIR/plan.json, DIR/dry_run.txt and
              DIR/configs/*.json when the verdict is OK (on FAIL nothing is written, exit 1); without --dry-run only
              the verdict, the warnings and errors and the file list are printed
config sections (moe_rl.launch.ClusterConfig): cluster, slurm, model, trainer, inference (prefill, decode, engine,
kv_offload, router), orchestrator, weights
"""


def _cluster(rest: list[str]) -> int:
    """``moe-rl cluster``: validate a cluster recipe, print/check its plan, write the sbatch script."""
    if "--version" in rest:
        print(_version())
        return 0
    if "-h" in rest or "--help" in rest:
        print(HELP_CLUSTER)
        return 0
    dry = "--dry-run" in rest
    rest = [a for a in rest if a != "--dry-run"]
    out = None
    args: list[str] = []
    i = 0
    while i < len(rest):
        if rest[i] == "--out":
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                print("moe-rl cluster: --out needs a directory", file=sys.stderr)
                return 2
            out, i = rest[i + 1], i + 2
        elif rest[i].startswith("--out="):
            out, i = rest[i].split("=", 1)[1], i + 1
        else:
            args.append(rest[i])
            i += 1
    if not dry and out is None:
        print("moe-rl cluster: give --dry-run, --out DIR, or both (see moe-rl cluster --help)", file=sys.stderr)
        return 2

    from moe_rl.config import ConfigError, load_config
    from moe_rl.launch.config import ClusterConfig
    from moe_rl.launch.dry_run import dry_run

    try:
        cfg = load_config(ClusterConfig, args)
    except ConfigError as exc:
        print(f"moe-rl cluster: {exc}", file=sys.stderr)
        return 2
    res = dry_run(cfg, out)
    if dry:
        print(res.text, end="")
    else:
        print(res.verdict)
        for w in res.warnings:
            print(f"WARNING: {w}")
        for e in res.errors:
            print(f"ERROR: {e}")
    if out is not None:
        if res.ok:
            print(f"moe-rl cluster: wrote {out}/job.sbatch, plan.json, dry_run.txt, configs/")
        else:
            print(f"moe-rl cluster: nothing written to {out} (the verdict is FAIL)", file=sys.stderr)
            from pathlib import Path

            if (Path(out) / "job.sbatch").exists():
                print(f"moe-rl cluster: {out}/job.sbatch is from an earlier run, not this config: do not submit it",
                      file=sys.stderr)
    if not res.ok:
        first_lines = "".join(f"\n  - {e.splitlines()[0]}" for e in res.errors)
        print(f"moe-rl cluster: {len(res.errors)} error(s) (details above):{first_lines}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
