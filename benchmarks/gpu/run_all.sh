#!/usr/bin/env bash
# One GPU validation pass: every GPU-marked test and every kernel benchmark, each under its own timeout,
# results as JSON with provenance. Sized for one H200 in under 10 minutes (default budget 540 s of steps).
#
#   benchmarks/gpu/run_all.sh [--out DIR] [--dry-run] [options]
#
# Output folder: --out DIR, else $OUT, else benchmarks/results/run_all_<UTC time>. It receives
#   provenance.json      machine, GPUs, driver, Python/torch/CUDA/NCCL/triton/deep_gemm/deep_ep versions, commit
#   summary.json         one entry per step: name, command, status, exit_code, seconds, timeout_s, log, reason,
#                        tail of the log when the step did not pass; rewritten after every step, so a run
#                        killed from outside still leaves the steps done so far
#   pytest_gpu.json      per-test outcome and duration of `pytest -m gpu` (from pytest_gpu.xml)
#   bench_pytest_gpu.json  pytest-benchmark JSON of GPU-marked benchmarks (when there are any)
#   <script outputs>     what each benchmarks/gpu/*.py writes into the folder (its own JSON with provenance)
#   logs/<step>.log      stdout + stderr of each step
#
# Steps, in order (a failing or timed-out step never stops the ones after it):
#   wheels       only when benchmarks/gpu/wheels/*.whl exist: `pip install --no-index --no-deps --target`
#                into a scratch dir put on PYTHONPATH (nothing else is installed, nothing is downloaded).
#                What a machine with only torch + triton lacks, fetched beforehand where the network is, for
#                the GPU machine's Python (here 3.11): pip download --only-binary=:all: --python-version 3.11
#                --platform manylinux2014_x86_64 -d benchmarks/gpu/wheels pytest pytest-benchmark pydantic
#                einops safetensors   (deep_gemm / deep_ep wheels, built for that machine, can go there too)
#   provenance   versions and devices; also counts the GPUs the later steps see
#   pytest_gpu   pytest -m gpu over the test files that use the `gpu` marker
#   <script>     every benchmarks/gpu/*.py (not _*.py), run as `python <script> --out DIR`. A script declares
#                other needs in a header line `# run_all: min_gpus=N torchrun timeout=S` (torchrun: launched
#                with torchrun --nproc_per_node=min(GPUs, 8)). ep_deepep.py (DeepEP dispatch/combine) needs
#                min_gpus=2 torchrun and is skipped, with the reason recorded, on a one-GPU machine.
#   bench_pytest_gpu  pytest-benchmark files under benchmarks/ that use the `gpu` marker
#
# Statuses: passed (exit 0), failed (other exit codes), unavailable (a benchmark script exited 2: its
# prerequisites are missing, e.g. no deep_ep), timeout (exit 124/137: killed by its timeout), empty (pytest
# collected nothing: exit 5), skipped (not run; `reason` says why). Exit status of this script: 0 when no step
# failed or timed out, 1 otherwise, 2 when there is no GPU (unless --allow-no-gpu) or on bad arguments.
#
# Options:
#   --dry-run            print the plan (one line per step) and exit; runs nothing, needs no GPU or torch
#   --gpus N             assume N GPUs (without it a real run counts them with torch, a dry run with nvidia-smi)
#   --budget S           seconds for all steps together (default 540); a step gets min(its timeout, time left)
#   --only REGEX         run only the steps whose name matches (grep -E); provenance always runs
#   --step NAME=CMD      add a step running `bash -c CMD` (e.g. rerun one test on a scarce GPU machine)
#   --step-timeout S     timeout of --step steps (default 120)
#   --allow-no-gpu       go on without a GPU (to exercise this script on CPU; GPU steps then skip or fail)
# Environment: PYTHON (interpreter; default .venv/bin/python when present, else python3), MOE_RL_COMMIT
# (commit to record when the tree carries no .git, e.g. a copy shipped to a GPU machine).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 2

run_provenance() {  # $1: output folder; internal step, see --internal-provenance
  "$PYTHON" - "$1" "$REPO" <<'PYEOF'
import datetime, importlib, importlib.metadata as md, json, os, platform, socket, subprocess, sys
out, repo = sys.argv[1], sys.argv[2]

def sh(*cmd):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=repo)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None

def version(dist, module=None):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        pass
    try:
        return getattr(importlib.import_module(module or dist), "__version__", "importable, no __version__")
    except Exception as exc:  # not installed or broken: record why
        return f"unavailable ({type(exc).__name__}: {str(exc)[:120]})"

commit = os.environ.get("MOE_RL_COMMIT") or sh("git", "rev-parse", "HEAD") or "unknown"
dirty = sh("git", "status", "--porcelain")
prov = {
    "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": commit,
    "working_tree_dirty": None if dirty is None else bool(dirty),
    "host": socket.gethostname(),
    "platform": platform.platform(),
    "cpu_count": os.cpu_count(),
    "python": sys.version.split()[0],
    "nvidia_smi": sh("nvidia-smi", "--query-gpu=index,name,memory.total,driver_version,pci.bus_id",
                     "--format=csv,noheader"),
    "versions": {name: version(*spec) for name, spec in {
        "torch": ("torch",), "triton": ("triton",), "deep_gemm": ("deep_gemm",), "deep_ep": ("deep_ep",),
        "pytest": ("pytest",), "pytest-benchmark": ("pytest-benchmark", "pytest_benchmark"),
        "pydantic": ("pydantic",), "numpy": ("numpy",), "moe_rl": ("moe_rl",)}.items()},
    "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "TRITON_INTERPRET")},
    "gpus": 0,
}
try:
    import torch
    prov["torch_cuda"] = torch.version.cuda
    prov["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        prov["gpus"] = torch.cuda.device_count()
        prov["devices"] = [{"name": torch.cuda.get_device_name(i),
                            "capability": list(torch.cuda.get_device_capability(i)),
                            "memory_GiB": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                           for i in range(prov["gpus"])]
        prov["cudnn"] = torch.backends.cudnn.version()
        try:
            prov["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:
            prov["nccl"] = f"unavailable ({exc})"
except Exception as exc:
    prov["torch_error"] = f"{type(exc).__name__}: {exc}"
# Which moe_rl packages import here (a bare GPU machine may lack a dependency); GPU machines only, it costs
# seconds and tells nothing on the CPU machines where the test suite already imports everything.
imports = {}
for mod in ("moe_rl.fp8", "moe_rl.moe", "moe_rl.models", "moe_rl.attention", "moe_rl.rl"):
    if not prov["gpus"]:
        imports[mod] = "not checked (no GPU)"
        continue
    try:
        importlib.import_module(mod)
        imports[mod] = "ok"
    except Exception as exc:
        imports[mod] = f"{type(exc).__name__}: {str(exc)[:200]}"
prov["moe_rl_imports"] = imports
with open(os.path.join(out, "provenance.json"), "w") as f:
    json.dump(prov, f, indent=1)
print(json.dumps(prov, indent=1))
PYEOF
}

OUT_DIR=""
DRY_RUN=0
GPUS_OVERRIDE=""
BUDGET=540
ONLY=""
STEP_TIMEOUT=120
ALLOW_NO_GPU=0
PROV_ONLY=""
EXTRA_NAMES=()
EXTRA_CMDS=()

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
die() { echo "run_all.sh: $*" >&2; exit 2; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) [[ $# -ge 2 ]] || die "--out needs a directory"; OUT_DIR="$2"; shift 2 ;;
    --out=*) OUT_DIR="${1#--out=}"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --gpus) [[ $# -ge 2 ]] && is_uint "$2" || die "--gpus needs a non-negative integer"; GPUS_OVERRIDE="$2"; shift 2 ;;
    --budget) [[ $# -ge 2 ]] && is_uint "$2" || die "--budget needs seconds (integer)"; BUDGET="$2"; shift 2 ;;
    --only) [[ $# -ge 2 ]] || die "--only needs a regular expression"; ONLY="$2"; shift 2 ;;
    --step)
      [[ $# -ge 2 && "$2" == *=* ]] || die "--step needs NAME=COMMAND, e.g. --step 'gemm=python -m pytest tests/fp8 -k gemm'"
      name="${2%%=*}"
      [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || die "--step name '$name' may use only letters, digits, '_', '.', '-'"
      EXTRA_NAMES+=("$name"); EXTRA_CMDS+=("${2#*=}"); shift 2 ;;
    --step-timeout) [[ $# -ge 2 ]] && is_uint "$2" || die "--step-timeout needs seconds (integer)"; STEP_TIMEOUT="$2"; shift 2 ;;
    --allow-no-gpu) ALLOW_NO_GPU=1; shift ;;
    --internal-provenance) [[ $# -ge 2 ]] || die "--internal-provenance needs a directory"; PROV_ONLY="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON="python3"; fi
fi
export PYTHON
command -v "$PYTHON" >/dev/null 2>&1 || die "no Python interpreter '$PYTHON' (set PYTHON=...)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
if [[ -n "$PROV_ONLY" ]]; then run_provenance "$PROV_ONLY"; exit $?; fi
[[ -n "$OUT_DIR" ]] || OUT_DIR="${OUT:-$REPO/benchmarks/results/run_all_$(date -u +%Y%m%dT%H%M%SZ)}"

# ------------------------------------------------------------------------------------------- the plan
# Parallel arrays, one entry per step. KIND: run (CMD under timeout) or skip (REASON).
NAMES=(); CMDS=(); TIMEOUTS=(); KINDS=(); REASONS=()
add_step() { NAMES+=("$1"); CMDS+=("$2"); TIMEOUTS+=("$3"); KINDS+=("$4"); REASONS+=("$5"); }

# Test / benchmark files that use the gpu marker (collecting only these keeps unrelated modules, whose
# dependencies a bare GPU machine may lack, out of the run).
gpu_marked_files() {  # $1: directory; prints paths relative to the repo, sorted
  grep -rlE --include='*.py' 'pytest\.mark\.gpu\b|^pytestmark *=.*\bgpu\b' "$1" 2>/dev/null | sort
}

count_gpus_quick() {  # no torch: CUDA_VISIBLE_DEVICES, else nvidia-smi, else 0
  if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
    local v="${CUDA_VISIBLE_DEVICES// /}"
    if [[ -z "$v" || "$v" == "-1" ]]; then echo 0; else echo $(( $(tr -cd ',' <<<"$v" | wc -c) + 1 )); fi
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
  else
    echo 0
  fi
}

directive() {  # $1: script, $2: key -> value of `# run_all: key=value` (or "1" for a bare key), else empty
  sed -n '1,40p' "$1" | grep -E '^# run_all:' | tr ' ' '\n' | sed -n "s/^$2=\(.*\)$/\1/p; s/^$2$/1/p" | head -n1
}

build_plan() {  # $1: number of GPUs
  local ngpu="$1" files script base min_gpus use_torchrun timeout nproc cmd
  if compgen -G "benchmarks/gpu/wheels/*.whl" >/dev/null; then
    add_step wheels "$PYTHON -m pip install --no-index --no-deps --target \"\$MOE_RL_GPU_SITE\" benchmarks/gpu/wheels/*.whl" 120 run ""
  fi
  add_step provenance "bash benchmarks/gpu/run_all.sh --internal-provenance \"\$OUT_DIR\"" 60 run ""

  files="$(gpu_marked_files tests | tr '\n' ' ')"
  if [[ -n "${files// /}" ]]; then
    add_step pytest_gpu "$PYTHON -m pytest -m gpu -v -p no:cacheprovider --continue-on-collection-errors -rA --durations=20 --junitxml=\"\$OUT_DIR/pytest_gpu.xml\" $files" 240 run ""
  else
    add_step pytest_gpu "" 0 skip "no test file under tests/ uses the gpu marker"
  fi

  for script in benchmarks/gpu/*.py; do
    [[ -e "$script" ]] || continue
    base="$(basename "$script" .py)"
    [[ "$base" == _* ]] && continue
    min_gpus="$(directive "$script" min_gpus)"; use_torchrun="$(directive "$script" torchrun)"
    timeout="$(directive "$script" timeout)"
    if [[ "$base" == "ep_deepep" ]]; then  # prepared before the directive convention; see its docstring
      min_gpus="${min_gpus:-2}"; use_torchrun="${use_torchrun:-1}"
    fi
    min_gpus="${min_gpus:-1}"; timeout="${timeout:-150}"
    is_uint "$min_gpus" || min_gpus=1
    is_uint "$timeout" || timeout=150
    if (( ngpu < min_gpus )); then
      local what="needs >= $min_gpus GPUs, this machine has $ngpu"
      [[ "$base" == "ep_deepep" ]] && what="$what (DeepEP dispatch/combine moves tokens between ranks: one process per GPU, NCCL)"
      add_step "$base" "" 0 skip "$what"
      continue
    fi
    if [[ "$use_torchrun" == 1 ]]; then
      nproc=$(( ngpu < 8 ? ngpu : 8 ))
      cmd="$PYTHON -m torch.distributed.run --standalone --nproc_per_node=$nproc $script --out \"\$OUT_DIR\""
    else
      cmd="$PYTHON $script --out \"\$OUT_DIR\""
    fi
    add_step "$base" "$cmd" "$timeout" run ""
  done

  files="$(gpu_marked_files benchmarks | grep -v '^benchmarks/gpu/' | tr '\n' ' ')"
  if [[ -n "${files// /}" ]]; then
    add_step bench_pytest_gpu "$PYTHON -m pytest -m gpu -p no:cacheprovider --benchmark-json=\"\$OUT_DIR/bench_pytest_gpu.json\" $files" 150 run ""
  else
    add_step bench_pytest_gpu "" 0 skip "no pytest-benchmark file under benchmarks/ uses the gpu marker"
  fi

  local i
  for i in "${!EXTRA_NAMES[@]}"; do
    add_step "${EXTRA_NAMES[$i]}" "${EXTRA_CMDS[$i]}" "$STEP_TIMEOUT" run ""
  done
}

selected() {  # $1: step name
  [[ "$1" == provenance || -z "$ONLY" ]] && return 0
  grep -qE -- "$ONLY" <<<"$1"
}

if [[ "$DRY_RUN" == 1 ]]; then
  ngpu="${GPUS_OVERRIDE:-$(count_gpus_quick)}"
  build_plan "$ngpu"
  echo "run_all.sh plan: out=$OUT_DIR python=$PYTHON gpus=$ngpu budget=${BUDGET}s"
  for i in "${!NAMES[@]}"; do
    if ! selected "${NAMES[$i]}"; then
      echo "SKIP ${NAMES[$i]} | not selected by --only '$ONLY'"
    elif [[ "${KINDS[$i]}" == skip ]]; then
      echo "SKIP ${NAMES[$i]} | ${REASONS[$i]}"
    else
      echo "STEP ${NAMES[$i]} | timeout ${TIMEOUTS[$i]}s | ${CMDS[$i]}"
    fi
  done
  exit 0
fi

# ------------------------------------------------------------------------------------------- running
mkdir -p "$OUT_DIR/logs" || die "cannot create the output folder '$OUT_DIR'"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
export OUT_DIR
MOE_RL_GPU_SITE="${TMPDIR:-/tmp}/moe_rl_gpu_site_$$"
export MOE_RL_GPU_SITE
trap 'rm -rf "$MOE_RL_GPU_SITE"' EXIT
if compgen -G "benchmarks/gpu/wheels/*.whl" >/dev/null; then
  export PYTHONPATH="$MOE_RL_GPU_SITE:$PYTHONPATH"
fi
STEPS_JSONL="$OUT_DIR/.steps.jsonl"
: >"$STEPS_JSONL"
RUN_START=$(date +%s)

# Writes summary.json from the step records (and pytest_gpu.json from the junit XML when present).
write_summary() {
  "$PYTHON" - "$OUT_DIR" "$BUDGET" "$RUN_START" "$1" <<'PYEOF'
import json, os, sys, time
import xml.etree.ElementTree as ET
out, budget, start, state = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
steps = [json.loads(l) for l in open(os.path.join(out, ".steps.jsonl")) if l.strip()]
for s in steps:
    log = s.get("log")
    if s["status"] not in ("passed", "skipped") and log and os.path.exists(os.path.join(out, log)):
        with open(os.path.join(out, log), errors="replace") as f:
            s["log_tail"] = f.read()[-3000:]
prov = {}
try:
    prov = json.load(open(os.path.join(out, "provenance.json")))
except (OSError, ValueError):
    pass
counts = {}
for s in steps:
    counts[s["status"]] = counts.get(s["status"], 0) + 1
xml_path = os.path.join(out, "pytest_gpu.xml")
outcomes = None
if os.path.exists(xml_path):
    try:
        cases = []
        for tc in ET.parse(xml_path).getroot().iter("testcase"):
            outcome, msg = "passed", ""
            for child in tc:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    msg = child.get("message", "")
                    break
            cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome,
                          "seconds": float(tc.get("time") or 0.0), "message": msg[:500]})
        outcomes = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
        with open(os.path.join(out, "pytest_gpu.json"), "w") as f:
            json.dump({"provenance": prov, "outcomes": outcomes, "tests": cases}, f, indent=1)
    except ET.ParseError:
        outcomes = "pytest_gpu.xml is not valid XML (pytest killed while writing it?)"
summary = {
    "state": state,
    "budget_s": budget,
    "wall_s": round(time.time() - start, 1),
    "counts": counts,
    "ok": not any(s["status"] in ("failed", "timeout") for s in steps),
    "commit": prov.get("commit"),
    "gpus": prov.get("gpus"),
    "pytest_gpu_outcomes": outcomes,
    "steps": steps,
}
tmp = os.path.join(out, ".summary.json.tmp")
with open(tmp, "w") as f:
    json.dump(summary, f, indent=1)
os.replace(tmp, os.path.join(out, "summary.json"))
PYEOF
}

record() {  # name status exit_code seconds timeout_s log reason command
  "$PYTHON" -c 'import json, sys
k = ["name", "status", "exit_code", "seconds", "timeout_s", "log", "reason", "command"]
v = dict(zip(k, sys.argv[1:]))
for key in ("exit_code", "timeout_s"):
    v[key] = int(v[key]) if v[key] not in ("", None) else None
v["seconds"] = float(v["seconds"])
v["log"] = v["log"] or None
v["reason"] = v["reason"] or None
print(json.dumps(v))' "$@" >>"$STEPS_JSONL"
  write_summary running
}


remaining() { echo $(( BUDGET - ($(date +%s) - RUN_START) )); }

run_step() {  # index
  local i="$1" name="${NAMES[$1]}" cmd="${CMDS[$1]}" cap="${TIMEOUTS[$1]}" log="logs/${NAMES[$1]}.log"
  local left t0 t1 rc status reason=""
  if ! selected "$name"; then
    record "$name" skipped "" 0 "" "" "not selected by --only '$ONLY'" "$cmd"; return
  fi
  if [[ "${KINDS[$i]}" == skip ]]; then
    echo "== $name: skipped (${REASONS[$i]})"
    record "$name" skipped "" 0 "" "" "${REASONS[$i]}" "$cmd"; return
  fi
  left="$(remaining)"
  if (( left < 15 )); then
    echo "== $name: skipped (budget of ${BUDGET}s spent)"
    record "$name" skipped "" 0 "" "" "budget of ${BUDGET}s spent before this step" "$cmd"; return
  fi
  (( cap > left )) && cap="$left"
  echo "== $name (timeout ${cap}s): $cmd"
  t0=$(date +%s.%N)
  timeout -k 10 "$cap" bash -c "$cmd" >"$OUT_DIR/$log" 2>&1 </dev/null
  rc=$?
  t1=$(date +%s.%N)
  case "$rc" in
    0) status=passed ;;
    124|137) status=timeout; reason="killed after ${cap}s" ;;
    5) if [[ "$cmd" == *"-m pytest"* ]]; then status=empty; reason="pytest collected no test"; else status=failed; fi ;;
    2) if [[ "$cmd" == *benchmarks/gpu/*.py* ]]; then status=unavailable; reason="the script exited 2: prerequisites missing (see log_tail)"; else status=failed; fi ;;
    *) status=failed ;;
  esac
  local secs; secs="$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')"
  echo "   -> $status (exit $rc, ${secs}s)"
  record "$name" "$status" "$rc" "$secs" "$cap" "$log" "$reason" "$cmd"
}

# wheels + provenance first: the GPU count decides the rest of the plan.
NAMES=(); CMDS=(); TIMEOUTS=(); KINDS=(); REASONS=()
build_plan 0   # a first plan only for the wheels/provenance steps
pre_n=1; [[ "${NAMES[0]}" == wheels ]] && pre_n=2
for (( i = 0; i < pre_n; i++ )); do run_step "$i"; done
ngpu="$("$PYTHON" -c 'import json,sys; print(int(json.load(open(sys.argv[1])).get("gpus") or 0))' "$OUT_DIR/provenance.json" 2>/dev/null || echo 0)"
[[ -n "$GPUS_OVERRIDE" ]] && ngpu="$GPUS_OVERRIDE"
if (( ngpu == 0 )) && [[ "$ALLOW_NO_GPU" != 1 ]]; then
  echo "run_all.sh: torch sees no CUDA GPU here (see $OUT_DIR/provenance.json); use --allow-no-gpu to go on" >&2
  write_summary "no GPU"
  exit 2
fi
NAMES=(); CMDS=(); TIMEOUTS=(); KINDS=(); REASONS=()
build_plan "$ngpu"
for i in "${!NAMES[@]}"; do
  (( i < pre_n )) && continue
  run_step "$i"
done
write_summary done
"$PYTHON" -c 'import json,sys; s=json.load(open(sys.argv[1])); print("run_all.sh:", s["counts"], "ok" if s["ok"] else "NOT ok", "->", sys.argv[1]); sys.exit(0 if s["ok"] else 1)' "$OUT_DIR/summary.json"
