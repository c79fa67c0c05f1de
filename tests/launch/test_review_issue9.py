"""Regression tests from the fresh-eyes review of issue 9 (``moe-rl cluster``): the Mooncake master is waited for
before its clients start, and two processes of one node may not listen on the same port."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.plan import build_plan
from moe_rl.launch.slurm import render_sbatch

REPO = Path(__file__).resolve().parents[2]
GLM = str(REPO / "recipes/glm5_1/rl.toml")


def _load(*overrides: str) -> ClusterConfig:
    return load_config(ClusterConfig, ["@", GLM, *overrides])


def test_sbatch_waits_for_the_mooncake_master_before_starting_its_clients():
    """mooncake_client connects to the master when it starts; without a wait it raced the master's startup."""
    plan = build_plan(_load())
    master = plan.by_role("mooncake_master")[0]
    assert master.health_url == "http://${HOST_16}:9003/health"
    assert "-metrics_port=9003" in master.argv  # the admin server that answers /health (checked live below)
    text = render_sbatch(plan)
    wait = text.index('wait_http "http://${HOST_16}:9003/health" "mooncake_master"')
    assert text.index("mooncake_master -rpc_port") < wait < text.index('NAMES+=("mooncake_client.n16")')


_FAKES = {
    "scontrol": "#!/bin/bash\nfor i in $(seq 0 27); do echo node$i; done\n",
    # the job binds each node's cluster interface: nodeN resolves to 10.0.0.N
    "getent": '#!/bin/bash\n[ -n "${FAKE_LOOPBACK:-}" ] && { echo "127.0.1.1 STREAM $2"; exit 0; }\n'
              'echo "10.0.0.${2#node} STREAM $2"\n',
    # every step stays up except the orchestrator, which ends the job with $ORCH_RC; a mooncake client can die
    "srun": (
        '#!/bin/bash\necho "srun $*" >> "$FAKE_LOG"\n'
        # the orchestrator ends the job once every step has logged its start (or after 20 s)
        'for a in "$@"; do case "$a" in *cluster_orchestrator*) for _ in $(seq 200); do '
        '[ "$(grep -c "^srun" "$FAKE_LOG")" -ge "$N_PROCS" ] && break; sleep 0.1; done; sleep "${ORCH_DELAY:-0}"; '
        'exit "${ORCH_RC:-0}";; '
        # with TRAINER_RC set, every trainer step exits with it once every step has started
        '*cluster_trainer*) if [ -n "${TRAINER_RC:-}" ]; then for _ in $(seq 200); do '
        '[ "$(grep -c "^srun" "$FAKE_LOG")" -ge "$N_PROCS" ] && break; sleep 0.1; done; exit "$TRAINER_RC"; fi;; '
        '*mooncake_client*) [ -n "${CLIENT_DIES:-}" ] && exit 3;; esac; done\nexec sleep 30\n'
    ),
    "curl": (
        '#!/bin/bash\necho "curl $*" >> "$FAKE_LOG"\n'
        'case "$*" in *:8000/health*) [ -n "${CLIENT_DIES:-}" ] && { sleep 0.5; exit 7; };; esac\nexit 0\n'
    ),
}


def _run_job(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    for name, body in _FAKES.items():
        f = tmp_path / name
        f.write_text(body)
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    plan = build_plan(_load("--slurm.setup", "[]"))
    job = tmp_path / "job.sbatch"
    job.write_text(render_sbatch(plan))
    log = tmp_path / "calls.log"
    full_env = {
        **os.environ,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "SLURM_JOB_NODELIST": "node[0-27]",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_JOB_ID": "7",
        "N_PROCS": str(len(plan.processes)),
        **env,
    }
    res = subprocess.run(["bash", str(job)], env=full_env, capture_output=True, text=True, timeout=60)
    return res, (log.read_text().splitlines() if log.exists() else [])


def test_sbatch_runs_under_fake_slurm(tmp_path):
    """The script as bash, with srun/scontrol/curl stubs: every process is started once, the master is polled
    before any client starts, the job ends with the orchestrator's status and kills the rest."""
    res, calls = _run_job(tmp_path, ORCH_RC="5")
    assert res.returncode == 5, res.stdout + res.stderr
    assert "orchestrator exited with status 5" in res.stdout
    starts = [c for c in calls if c.startswith("srun ")]
    assert len(starts) == 43
    # the poll runs in the foreground, so it is logged before any client's step is even spawned
    first_client = next(i for i, c in enumerate(calls) if "mooncake_client" in c)
    assert calls.index("curl -sf -o /dev/null http://node16:9003/health") < first_client
    assert "-host=node17" in " ".join(calls)  # ${HOST_i} expanded from scontrol's list


def test_sbatch_binds_cluster_addresses_and_keeps_the_token_secret(tmp_path):
    """Servers bind the resolved cluster address (not 0.0.0.0), engines load the control middleware, the token
    lands in ${RUN_DIR}/control_token with mode 0600 and appears in no command line and no output."""
    token = "job-token-" + "z" * 30
    res, calls = _run_job(tmp_path, ORCH_RC="0", MOE_RL_CONTROL_TOKEN=token)
    assert res.returncode == 0, res.stdout + res.stderr
    joined = "\n".join(calls)
    assert "0.0.0.0" not in joined
    engines = [c for c in calls if " serve " in c and "--headless" not in c]
    assert engines and all("--middleware moe_rl.inference.control_plane.ControlTokenMiddleware" in c for c in engines)
    assert any("--host 10.0.0.16 --port 8000" in c for c in engines)
    assert any("vllm-router --host 127.0.0.1" in c for c in calls)  # beside the orchestrator, off the network
    assert any("MOE_RL_WEIGHTS_ROOT=" in c and "/weights" in c for c in engines)
    run_dir = next(tmp_path.rglob("control_token"))
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o600 and run_dir.read_text().strip() == token
    assert token not in joined + res.stdout + res.stderr


def test_sbatch_refuses_loopback_addresses(tmp_path):
    res, calls = _run_job(tmp_path, ORCH_RC="0", FAKE_LOOPBACK="1")
    assert res.returncode == 2 and "not a cluster interface address" in res.stderr
    assert not [c for c in calls if c.startswith("srun ")]


def test_sbatch_waits_for_the_orchestrator_after_the_trainer_finishes(tmp_path):
    """The trainer exits 0 after its last step; the orchestrator still loads the final version and writes the
    summary: the job must wait for it and end with its status (0), not fail on the trainer's exit."""
    res, _ = _run_job(tmp_path, TRAINER_RC="0", ORCH_DELAY="4", ORCH_RC="0")
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"trainer\.n\d+ exited with status 0", res.stdout)
    assert "orchestrator exited with status 0" in res.stdout


def test_sbatch_fails_when_the_trainer_fails(tmp_path):
    res, _ = _run_job(tmp_path, TRAINER_RC="3", ORCH_DELAY="20")
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(r"trainer\.n\d+ exited with status 3", res.stdout)


def test_sbatch_fails_fast_when_a_process_dies_during_startup(tmp_path):
    res, _ = _run_job(tmp_path, CLIENT_DIES="1")
    assert res.returncode == 1
    assert re.search(r"mooncake_client\.n\d+ exited during startup", res.stderr)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            ["--inference.router.port", "29500"],
            "inference.router.port=29500 and trainer.rdzv_port=29500 are both listened on by trainer node 0",
        ),
        (
            ["--inference.kv-offload.metrics-port", "8080"],
            "inference.kv_offload.metrics_port=8080 and inference.kv_offload.metadata_port=8080",
        ),
        (
            ["--inference.decode.dp-rpc-port", "50052"],
            "inference.kv_offload.client_port=50052 and inference.decode.dp_rpc_port=50052 are both listened on by "
            "the decode nodes",
        ),
    ],
)
def test_port_clash_on_one_node_is_a_config_error(override, message):
    with pytest.raises((ConfigError, ValueError)) as exc:
        _load(*override)
    assert message in str(exc.value)
    assert "give one of them another port" in str(exc.value)


def test_mooncake_master_serves_health_on_its_metrics_port(tmp_path):
    """The readiness URL the script polls is real: the installed mooncake_master answers 200 on
    ``-metrics_port``'s ``/health`` (the metadata server's /metadata answers 400 without a key)."""
    import socket
    import time
    import urllib.request

    exe = REPO / ".venv/bin/mooncake_master"
    if not exe.exists():
        pytest.skip("mooncake_master is not installed (the mooncake extra)")

    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    rpc, meta, metrics = free(), free(), free()
    argv = [
        str(exe),
        f"-rpc_port={rpc}",
        "-enable_http_metadata_server=true",
        "-http_metadata_server_host=127.0.0.1",
        f"-http_metadata_server_port={meta}",
        f"-metrics_port={metrics}",
        "-metrics_host=127.0.0.1",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, status = time.monotonic() + 20, None
        while time.monotonic() < deadline and status is None:
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/health", timeout=1).status
            except OSError:
                time.sleep(0.1)
        assert status == 200
    finally:
        proc.terminate()
        proc.wait(10)


def test_sbatch_asks_for_all_node_memory():
    """``--exclusive`` alone leaves the job's memory at the cluster's DefMemPerCPU/DefMemPerNode on many Slurm
    sites; the recipe needs > 1 TiB of host memory per inference node (Mooncake segment) and the AdamW state on
    the trainer nodes, so the job asks for all of it (``--mem=0``)."""
    text = render_sbatch(build_plan(_load()))
    assert "\n#SBATCH --mem=0\n" in text


def test_engines_serve_the_name_the_orchestrator_asks_for():
    """``VllmClient`` sends ``model="policy"`` by default (as ``VllmServerConfig.served_model_name``); without
    ``--served-model-name`` a GPU engine served ``zai-org/GLM-5.1-FP8`` and answered 404 to it."""
    import inspect

    from moe_rl.inference.client import VllmClient

    default = inspect.signature(VllmClient).parameters["model"].default
    plan = build_plan(_load())
    engines = plan.by_role("prefill") + plan.by_role("decode")
    assert len(engines) == 12
    for p in engines:
        assert p.argv[p.argv.index("--served-model-name") + 1] == default == "policy"
    renamed = build_plan(_load("--inference.served-model-name", "glm"))
    assert all("glm" == p.argv[p.argv.index("--served-model-name") + 1] for p in renamed.by_role("decode"))
