"""Render a :class:`moe_rl.launch.plan.LaunchPlan` as a Slurm batch script (``templates/cluster.sbatch.j2``).

The script resolves hostnames with ``scontrol show hostnames "$SLURM_JOB_NODELIST"`` into ``HOST_0 .. HOST_{N-1}``
and their cluster-interface IPv4 addresses (``getent ahostsv4``; loopback answers are refused) into
``ADDR_0 .. ADDR_{N-1}``, which the servers bind; sets the run's control token (``MOE_RL_CONTROL_TOKEN`` from the
submitting environment, else ``$RUN_DIR/control_token`` -- refused unless a regular file owned by the job's user with
mode 600 --, else a fresh one; refused with exit code 2 and a message naming its source, never its value, unless it
has ``TOKEN_MIN_CHARS`` characters of ``TOKEN_CHARSET`` with ``TOKEN_MIN_DISTINCT`` distinct ones
(:mod:`moe_rl.inference.control_plane`); kept in ``$RUN_DIR/control_token`` with mode 0600 and exported to every step
with ``VLLM_API_KEY``, never echoed, never on a command line, handled with ``set -x`` off),
writes the plan's files under ``$RUN_DIR``, starts every process as a one-node ``srun --overlap`` step (GPU steps with
``--gres``) stage by stage, waits for each stage's health endpoints (failing fast when a started process dies), and
ends when the orchestrator exits, with its status (a trainer exiting 0 has finished; any other exit fails the job). Every step's output
goes to ``$RUN_DIR/logs/<name>.log``. Same approach as prime-rl's ``templates/*.sbatch.j2``; the script is ours.

Quoting: every argv token is single-quoted unless it refers to ``${HOST_<i>}``, ``${ADDR_<i>}``, ``${RUN_DIR}`` or
``${SLURM_JOB_ID}``;
those are double-quoted with every other ``$``, backquote, backslash and double quote escaped, so only these
references expand.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from moe_rl.inference.control_plane import TOKEN_CHARSET, TOKEN_MIN_CHARS, TOKEN_MIN_DISTINCT
from moe_rl.launch.plan import LaunchPlan, Process, host

__all__ = ["render_sbatch", "shell_token", "process_command"]

_REF = re.compile(r"\$\{(HOST_\d+|ADDR_\d+|RUN_DIR|SLURM_JOB_ID)\}")
_STAGE_LABELS = {0: "Mooncake master", 1: "Mooncake clients (one per inference node)", 2: "vLLM engines",
                 3: "router", 4: "trainer (torchrun, one per trainer node)", 5: "orchestrator"}


_DQ_SPECIAL = re.compile(r'([\\`"$])')  # special inside double quotes: backslash, backquote, double quote, $
_HEREDOC_SPECIAL = re.compile(r"([\\`$])")  # special in an unquoted heredoc body (double quotes are not)


def _escape_outside_refs(text: str, special: re.Pattern[str]) -> str:
    """Backslash-escape every character ``special`` matches, except inside the allowed references (``_REF``), which
    stay live."""
    out, pos = [], 0
    for m in _REF.finditer(text):
        out.append(special.sub(r"\\\1", text[pos:m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(special.sub(r"\\\1", text[pos:]))
    return "".join(out)


def _escape_dq(text: str) -> str:
    """Escape ``text`` for a double-quoted shell word, keeping only the allowed references live."""
    return _escape_outside_refs(text, _DQ_SPECIAL)


def shell_token(token: str) -> str:
    """One argv token as shell source: literal, except ``${HOST_i}``, ``${ADDR_i}``, ``${RUN_DIR}``,
    ``${SLURM_JOB_ID}``."""
    if _REF.search(token) is None:
        return shlex.quote(token)
    return '"' + _escape_dq(token) + '"'


def process_command(plan: LaunchPlan, p: Process) -> str:
    """The ``srun ... env K=V ... argv`` line of one process (without the redirection and ``&``). Variables of
    ``p.token_env`` are assigned ``"$MOE_RL_CONTROL_TOKEN"`` in front of ``srun`` (exported to the step, expanded by
    the batch shell: the token is on no command line)."""
    slurm = plan.config.slurm
    parts = [f'{k}="$MOE_RL_CONTROL_TOKEN"' for k in p.token_env]
    parts += ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={shell_token(host(p.node))}", "--overlap",
             "--kill-on-bad-exit=1"]
    if p.gpus:
        parts.append("--gres=" + slurm.gpu_gres.format(gpus_per_node=plan.config.cluster.gpus_per_node))
    parts += [shell_token(a) for a in slurm.srun_args]
    if p.env:
        parts.append("env")
        parts += [shell_token(f"{k}={v}") for k, v in sorted(p.env.items())]
    parts += [shell_token(a) for a in p.argv]
    return " ".join(parts)


def render_sbatch(plan: LaunchPlan) -> str:
    """The batch script of ``plan`` (text; ``bash -n`` accepts it).

    Raises:
        ImportError: Jinja2 is missing (it ships with torch; ``pip install jinja2``).
    """
    try:
        import jinja2
    except ImportError as exc:  # pragma: no cover - jinja2 comes with torch
        raise ImportError("rendering the sbatch script needs jinja2: pip install jinja2") from exc
    cfg = plan.config
    template_dir = Path(__file__).parent / "templates"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False,
                             comment_start_string="<#--", comment_end_string="--#>")  # bash has ${#ARR[@]}
    stages = []
    for s in sorted({p.stage for p in plan.processes}):
        procs = [p for p in plan.processes if p.stage == s]
        stages.append({
            "index": s,
            "label": _STAGE_LABELS.get(s, "processes"),
            "processes": [{"name": p.name, "node": p.node, "command": process_command(plan, p)} for p in procs],
            "health": [{"name": p.name, "url": _escape_dq(p.health_url)} for p in procs if p.health_url],
        })
    files = []
    for path, content in plan.files.items():
        expand = path in plan.expand
        files.append({"path": path, "expand": expand,
                      "content": (_escape_dq_heredoc(content) if expand else content)})
    return env.get_template("cluster.sbatch.j2").render(
        name=cfg.name, num_nodes=cfg.cluster.num_nodes, slurm=cfg.slurm,
        gres=cfg.slurm.gpu_gres.format(gpus_per_node=cfg.cluster.gpus_per_node),
        run_dir=_escape_run_dir(cfg.slurm.run_dir), files=files, stages=stages, processes=plan.processes,
        node_summary=plan.node_summary(),
        token_min_chars=TOKEN_MIN_CHARS, token_min_distinct=TOKEN_MIN_DISTINCT, token_charset=TOKEN_CHARSET,
    )


def _escape_dq_heredoc(text: str) -> str:
    """An unquoted heredoc body: backslash, backquote and ``$`` are special (double quotes are not)."""
    return _escape_outside_refs(text, _HEREDOC_SPECIAL)


def _escape_run_dir(run_dir: str) -> str:
    """``slurm.run_dir`` inside double quotes: ``${VAR}`` / ``$VAR`` references of the job's environment stay live
    (e.g. ``${SLURM_SUBMIT_DIR}``), backquotes, backslashes and double quotes are escaped."""
    return re.sub(r'([\\`"])', r"\\\1", run_dir)

