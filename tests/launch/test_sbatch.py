"""The rendered Slurm script: ``bash -n`` accepts it, it launches every process once, and its quoting expands only
``${HOST_i}`` / ``${RUN_DIR}`` / ``${SLURM_JOB_ID}`` (checked by running bash on the quoted tokens)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.plan import build_plan
from moe_rl.launch.slurm import process_command, render_sbatch, shell_token

REPO = Path(__file__).resolve().parents[2]
RECIPES = ["glm5_1", "kimi_k2_7_code", "nemotron_3_ultra_550b"]


@pytest.mark.parametrize("name", RECIPES)
def test_sbatch_renders_and_parses(name, tmp_path):
    plan = build_plan(load_config(ClusterConfig, ["@", str(REPO / f"recipes/{name}/rl.toml")]))
    text = render_sbatch(plan)
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    n = plan.config.cluster.num_nodes
    assert f"#SBATCH --nodes={n}\n" in text
    assert 'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in text
    assert all(f'HOST_{i}="${{HOSTS[{i}]}}"' in text for i in range(n))
    starts = re.findall(r'^PIDS\+=\(\$!\); NAMES\+=\("([^"]+)"\)$', text, flags=re.M)
    assert starts == [p.name for p in plan.processes]  # each process started once, in stage order
    for p in plan.processes:
        assert process_command(plan, p) in text
    health = re.findall(r'^wait_http "([^"]+)"', text, flags=re.M)
    assert len(health) == len([p for p in plan.processes if p.health_url])


def test_shell_quoting_expands_only_the_plan_variables(tmp_path):
    tokens = [
        "${HOST_3}:29500", "--rdzv-id=${SLURM_JOB_ID}", "${RUN_DIR}/configs/x.json", '{"a":"b c","d":[1,2]}',
        "$HOME literal", "back`tick`", 'quote"d ${HOST_0}', "a\\b ${HOST_12}$x", "${PATH}", "plain",
    ]
    script = tmp_path / "q.sh"
    script.write_text(
        "HOST_0=h0; HOST_3=h3; HOST_12=h12; RUN_DIR=/r; SLURM_JOB_ID=77; x=NO\n"
        "printf '%s\\n' " + " ".join(shell_token(t) for t in tokens) + "\n"
    )
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout.splitlines()
    expected = [
        "h3:29500", "--rdzv-id=77", "/r/configs/x.json", '{"a":"b c","d":[1,2]}', "$HOME literal", "back`tick`",
        'quote"d h0', "a\\b h12$x", "${PATH}", "plain",
    ]
    assert out == expected


def test_heredoc_files_expand_hosts_only(tmp_path):
    plan = build_plan(load_config(ClusterConfig, ["@", str(REPO / "recipes/glm5_1/rl.toml")]))
    text = render_sbatch(plan)
    # run only the file-writing part of the script with fake hosts and a temporary run dir
    start = text.index('RUN_DIR="')
    end = text.index("PIDS=()")
    n = plan.config.cluster.num_nodes
    prelude = "".join(f"HOST_{i}=node{i}\n" for i in range(n)) + f"SLURM_SUBMIT_DIR={tmp_path}\nSLURM_JOB_ID=5\n"
    script = tmp_path / "files.sh"
    script.write_text(prelude + text[start:end])
    subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True)
    run = tmp_path / "runs" / "5"
    store = json.loads((run / "configs/mooncake_store.json").read_text())
    assert store["master_server_address"] == "node16:50051"
    cluster = json.loads((run / "configs/cluster.json").read_text())
    assert cluster["slurm"]["run_dir"] == "${SLURM_SUBMIT_DIR}/runs/${SLURM_JOB_ID}"  # written literally
    assert cluster == json.loads(plan.files["configs/cluster.json"])


def test_pd_router_gets_the_token_in_its_environment_not_on_its_command_line(tmp_path):
    """vllm-router in P/D mode authenticates to the engines with ``$OPENAI_API_KEY`` (it drops the client's header):
    the router's step gets the control token in that variable; no command line holds the token."""
    plan = build_plan(load_config(ClusterConfig, ["@", str(REPO / "recipes/glm5_1/rl.toml")]))
    assert plan.config.inference.mode == "disaggregated"
    by_role = {p.role: p for p in plan.processes}
    line = process_command(plan, by_role["router"])
    assert line.startswith('OPENAI_API_KEY="$MOE_RL_CONTROL_TOKEN" srun ')
    assert all("OPENAI_API_KEY" not in process_command(plan, p) for p in plan.processes if p.role != "router")
    # run the line with a stand-in srun that reports what its step would see
    script = tmp_path / "run.sh"
    script.write_text(
        'srun() { printf "env=%s\\n" "$OPENAI_API_KEY"; printf "arg=%s\\n" "$@"; }\n'
        "MOE_RL_CONTROL_TOKEN=tok-abc123; HOST_0=h0; RUN_DIR=/r; SLURM_JOB_ID=1\n" + line + "\n"
    )
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert "env=tok-abc123" in out
    assert not any("tok-abc123" in o for o in out if o.startswith("arg="))
