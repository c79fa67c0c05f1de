"""The main job's command line and run directory without a vLLM server: an earlier run is refused unless
--overwrite, --help per section, --version, no traceback on a closed stdout, summary.json + curves.png for a failed
or interrupted run, the progress bar, the compact versions map, the optional metric sinks."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_rl.cli import main
from moe_rl.config import load_config
from moe_rl.entrypoints import rl as rl_entry
from moe_rl.entrypoints.rl import (
    RunDirInUse,
    RunFailed,
    compact_versions,
    prepare_run_dir,
    run_rl,
    write_summary,
)
from moe_rl.runtime.config import RLConfig
from moe_rl.runtime.run_dir import RunPaths

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes/debug_cpu/rl.toml")


def _earlier_run(root: Path) -> None:
    root.mkdir(parents=True)
    (root / rl_entry.RUN_MARKER).write_text("moe-rl rl run directory\n")
    (root / "sft").mkdir()
    (root / "sft" / "sft.json").write_text("{}")
    (root / "weights" / "step_3").mkdir(parents=True)
    (root / "metrics.jsonl").write_text('{"step": 0}\n')
    (root / "summary.json").write_text(json.dumps({"exit": {"status": "failed", "cause": "vLLM server died"}}))
    (root / "logs").mkdir()


def test_an_earlier_run_is_refused_and_nothing_deleted(tmp_path):
    root = tmp_path / "run"
    _earlier_run(root)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(RunDirInUse) as err:
        prepare_run_dir(RunPaths(root))
    msg = str(err.value)
    assert str(root) in msg and "--overwrite" in msg and "another --output-dir" in msg and "Nothing was deleted" in msg
    assert "failed: vLLM server died" in msg and "metrics.jsonl" in msg
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_overwrite_deletes_the_run_files_and_keeps_the_sft_cache(tmp_path):
    root = tmp_path / "run"
    _earlier_run(root)
    deleted = prepare_run_dir(RunPaths(root), "overwrite")
    assert {p.name for p in deleted} == {"weights", "metrics.jsonl", "summary.json", "logs"}
    assert not (root / "weights").exists() and not (root / "summary.json").exists()
    assert (root / "sft" / "sft.json").exists()
    # a directory with only the SFT cache (or nothing) holds no run: used without a flag
    assert prepare_run_dir(RunPaths(root)) == []
    assert prepare_run_dir(RunPaths(tmp_path / "new")) == [] and (tmp_path / "new" / rl_entry.RUN_MARKER).exists()
    with pytest.raises(ValueError, match="existing='resume' must be 'refuse' or 'overwrite'"):
        prepare_run_dir(RunPaths(root), "resume")


def test_cli_refuses_an_earlier_run_with_exit_2(tmp_path, capsys):
    root = tmp_path / "run"
    _earlier_run(root)
    assert main(["rl", "@", RECIPE, "--output-dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite" in err and "Traceback" not in err
    assert (root / "metrics.jsonl").exists()
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    assert main(["rl", "@", RECIPE, "--output-dir", str(root), "--resume"]) == 2  # no checkpoint to continue from
    err = capsys.readouterr().err
    assert "--resume" in err and "has no complete checkpoint" in err and "no checkpoints/" in err, err
    assert "Traceback" not in err
    assert main(["rl", "@", RECIPE, "--output-dir", str(root), "--resume", "--overwrite"]) == 2
    assert "--resume and --overwrite exclude each other" in capsys.readouterr().err
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing changed
    assert main(["rl", "@", RECIPE, "--output-dir", str(tmp_path / "none"), "--resume"]) == 2
    assert "holds no moe-rl rl run" in capsys.readouterr().err


def test_version(capsys):
    from moe_rl import __version__

    for argv in (["--version"], ["rl", "--version"], ["cluster", "--version"]):
        assert main(argv) == 0
        assert capsys.readouterr().out.strip() == f"moe-rl {__version__}"


def test_help_per_section_shows_type_default_and_doc(capsys):
    assert main(["rl", "--help", "trainer.optim"]) == 0
    out = capsys.readouterr().out
    assert "--trainer.optim.lr: float = 0.0003  (gt=0.0, le=1.0)\n    Peak learning rate." in out
    assert main(["rl", "--help", "model"]) == 0
    out = capsys.readouterr().out
    # the defaults are RLConfig's (the tiny debug model), not GlmMoeConfig's class defaults
    assert "--model.hidden_size: int = 128" in out and "Residual stream width D." in out
    assert main(["rl", "--help", "metrics"]) == 0
    assert "--metrics.tensorboard: bool = False" in capsys.readouterr().out
    assert main(["rl", "--help"]) == 0
    assert "moe-rl rl --help SECTION" in capsys.readouterr().out
    assert main(["rl", "--help", "nope"]) == 2
    assert "has no section 'nope'; sections: model, task" in capsys.readouterr().err


def test_help_all_documents_every_field_of_the_run_level():
    from moe_rl.config import describe_config

    text = describe_config(RLConfig)
    for name in ("output_dir", "seed", "max_steps", "alphabet", "env", "env_args"):
        line = next(i for i, x in enumerate(text.splitlines()) if x.startswith(f"--{name}:"))
        assert text.splitlines()[line + 1].startswith("    ") and "(undocumented)" not in text.splitlines()[line + 1]
    assert "--output_dir: Path = (required)" in text


def test_a_closed_stdout_ends_without_a_traceback(tmp_path):
    argv = [sys.executable, "-m", "moe_rl.cli", "rl", "@", RECIPE, "--output-dir", str(tmp_path / "r"), "--dry-run"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first byte (like `| head` after its lines)
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 1


class _DyingServer:
    """Stands in for ``VllmServer``: ``start`` raises ``exc``."""

    exc: BaseException = RuntimeError("engine start failed: boom")

    def __init__(self, cfg, model_dir, log_path):
        self.pid = 0

    def start(self):
        raise self.exc

    def stop(self):
        pass


@pytest.mark.parametrize("exc, status, code", [(RuntimeError("engine start failed: boom"), "failed", 1),
                                               (KeyboardInterrupt("SIGTERM"), "interrupted", 130)])
def test_a_failed_or_interrupted_run_writes_summary_and_curves(tmp_path, monkeypatch, exc, status, code):
    import moe_rl.inference

    monkeypatch.setattr(rl_entry, "prepare_initial_weights", lambda cfg, paths: {"enabled": False})
    monkeypatch.setattr(_DyingServer, "exc", exc)
    monkeypatch.setattr(moe_rl.inference, "VllmServer", _DyingServer)
    root = tmp_path / "run"
    cfg = load_config(RLConfig, ["@", RECIPE, "--output-dir", str(root)])
    with pytest.raises(RunFailed if status == "failed" else KeyboardInterrupt):
        run_rl(cfg)
    summary = json.loads((root / "summary.json").read_text())
    assert summary["exit"]["status"] == status and summary["exit"]["code"] == code
    assert ("boom" if status == "failed" else "SIGTERM") in summary["exit"]["cause"]
    assert summary["reward_first5"] is None and summary["sft"] == {"enabled": False}
    assert (root / "curves.png").stat().st_size > 1000
    with pytest.raises(RunDirInUse, match=f"already holds a run \\({status}"):  # and it is not deleted silently
        run_rl(cfg)


class _NeverReadyServer(_DyingServer):
    """Stands in for ``VllmServer``: ``start`` launches nothing, ``wait_ready`` fails (a server that exits while
    starting)."""

    def start(self):
        pass

    def wait_ready(self, check=None):
        raise RuntimeError("vLLM server exited with code 1 before it was ready: boom")


class _SlowServer(_DyingServer):
    """Stands in for ``VllmServer``: ``wait_ready`` polls ``check`` for up to 60 s, as the real one does."""

    def start(self):
        pass

    def wait_ready(self, check=None):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if check is not None:
                check()
            time.sleep(0.05)
        raise AssertionError("the trainer's death was not noticed while the engine started")


def test_the_trainer_starts_beside_the_engines_and_is_stopped_when_they_fail(tmp_path, monkeypatch):
    import moe_rl.inference

    started: list = []

    def fake_trainer(cfg, paths, affinity):  # a real child process, cheap: it only sleeps
        proc = rl_entry._Proc("trainer (torchrun)", [sys.executable, "-c", "import time; time.sleep(120)"],
                              {}, paths.logs / "trainer.log", affinity)
        started.append(proc)
        return proc

    monkeypatch.setattr(rl_entry, "prepare_initial_weights", lambda cfg, paths: {"enabled": False})
    monkeypatch.setattr(rl_entry, "_start_trainer", fake_trainer)
    monkeypatch.setattr(moe_rl.inference, "VllmServer", _NeverReadyServer)
    root = tmp_path / "run"
    cfg = load_config(RLConfig, ["@", RECIPE, "--output-dir", str(root)])
    with pytest.raises(RunFailed):
        run_rl(cfg)
    # the trainer was started before the engines were ready (their start-ups overlap), and stopped with them
    assert len(started) == 1 and started[0].poll() is not None
    summary = json.loads((root / "summary.json").read_text())
    assert summary["exit"]["status"] == "failed" and "boom" in summary["exit"]["cause"]


def test_a_trainer_that_dies_while_the_engines_start_fails_the_run_at_once(tmp_path, monkeypatch):
    import moe_rl.inference

    def dying_trainer(cfg, paths, affinity):
        return rl_entry._Proc("trainer (torchrun)", [sys.executable, "-c", "raise SystemExit(3)"], {},
                              paths.logs / "trainer.log", affinity)

    monkeypatch.setattr(rl_entry, "prepare_initial_weights", lambda cfg, paths: {"enabled": False})
    monkeypatch.setattr(rl_entry, "_start_trainer", dying_trainer)
    monkeypatch.setattr(moe_rl.inference, "VllmServer", _SlowServer)
    root = tmp_path / "run"
    cfg = load_config(RLConfig, ["@", RECIPE, "--output-dir", str(root)])
    t0 = time.monotonic()
    with pytest.raises(RunFailed, match=r"trainer \(torchrun\) \(pid \d+\) exited with code 3 while the vLLM engines "
                                        r"started"):
        run_rl(cfg)
    assert time.monotonic() - t0 < 50  # not after the engine's start-up
    assert json.loads((root / "summary.json").read_text())["exit"]["status"] == "failed"


def test_progress_bar_count_and_numbers_agree():
    buf = io.StringIO()
    bar = rl_entry._Progress(5, file=buf)
    assert bar.bar.desc.startswith("rl: first step")
    bar.step({"reward_mean": 0.1, "mismatch_kl": 1e-3, "staleness_max": 0})
    assert bar.bar.n == 1 and "reward=0.100" in str(bar.bar) and "1/5" in str(bar.bar)
    # the rate counts from the first step on: no estimate from the warm-up
    assert bar.bar.format_dict["rate"] is None and "<?" in str(bar.bar)
    bar.step({"reward_mean": 0.2, "mismatch_kl": 1e-3, "staleness_max": 1})
    assert bar.bar.n == 2 and "reward=0.200" in str(bar.bar) and "stale=1" in str(bar.bar) and "2/5" in str(bar.bar)
    bar.close()


def test_compact_versions_and_summary_without_steps(tmp_path):
    loaded = {str(v): "filesystem" for v in (1, 2, 3, 5, 8, 9)} | {"4": "mooncake"}
    assert compact_versions(loaded) == {"count": 7, "first": 1, "last": 9, "gaps": [[6, 7]], "ranges_by_source": {
        "filesystem": [[1, 3], [5, 5], [8, 9]], "mooncake": [[4, 4]]}}
    assert compact_versions({str(v): "filesystem" for v in range(1, 500)})["ranges_by_source"] == {
        "filesystem": [[1, 499]]}
    assert compact_versions({}) == {"count": 0, "first": None, "last": None, "gaps": [], "ranges_by_source": {}}
    s = write_summary(RunPaths(tmp_path), {"weight_transport": {"versions_loaded": {"1": "a", "2": "a"}}})
    assert s["weight_transport"]["versions_loaded"] == {"count": 2, "first": 1, "last": 2, "gaps": [],
                                                        "ranges_by_source": {"a": [[1, 2]]}}
    assert s["mismatch_kl_max"] is None and (tmp_path / "curves.png").exists()


def test_settled_task_failures_are_not_reported_as_never_retrieved():
    from moe_rl.runtime.orchestrator import _settle

    reports: list[dict] = []

    async def fail():
        raise ConnectionError("engine gone")

    async def body():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reports.append(ctx))
        t = asyncio.create_task(fail())
        await asyncio.sleep(0)
        await _settle([t], timeout=1.0)
        del t
        gc.collect()

    asyncio.run(body())
    assert not [r for r in reports if "never retrieved" in r.get("message", "")]


def test_metric_sinks_tensorboard_and_missing_package(tmp_path, monkeypatch):
    from moe_rl.runtime.sinks import MetricSinks, MetricSinksConfig, numeric_fields

    assert numeric_fields({"a": 1, "b": True, "c": None, "d": {"e": 2.5}, "f": "x"}) == {"a": 1.0, "d/e": 2.5}
    off = MetricSinks(MetricSinksConfig(), tmp_path)
    assert off.enabled == [] and not (tmp_path / "tensorboard").exists()
    pytest.importorskip("tensorboard")
    sinks = MetricSinks(MetricSinksConfig(tensorboard=True), tmp_path)
    sinks.log({"step": 0, "reward_mean": 0.5, "loss": 1.0})
    sinks.close()
    assert sinks.enabled == [] and list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    for name in ("tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
        with pytest.raises(ImportError, match=f"metrics.{name}=true needs the '{name}' package.*pip install {name}"):
            MetricSinks(MetricSinksConfig(**{name: True}), tmp_path)


@pytest.mark.slow
def test_metric_sink_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from moe_rl.runtime.sinks import MetricSinks, MetricSinksConfig

    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = MetricSinks(MetricSinksConfig(wandb=True), tmp_path, {"seed": 0})
    assert sinks.enabled == ["wandb"]
    sinks.log({"step": 0, "reward_mean": 0.5})
    sinks.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
