#!/usr/bin/env bash
# The device check (issue 37 item 6), one command: on a CUDA machine it runs the tests that
# exercise CUDA (those whose names or skips mention cuda) and the Triton kernel tests compiled
# on the GPU; on a CPU machine it says so and runs the Triton tests in the interpreter
# (TRITON_INTERPRET=1, set by tests/triton_kernels/conftest.py). Either way it writes one
# JSON (default device_check.json, or $1) with the device, versions and each run's result.
# No GPU benchmark yet: scripts/bench.py --gpu is not written (docs/performance.md#gpus).
set -u
cd "$(dirname "$0")/.."
OUT="${1:-device_check.json}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOGDIR="$(mktemp -d)"

run() {  # run NAME PYTEST_ARGS...: pytest, its exit code and summary line to $LOGDIR/NAME.*
  local name="$1"; shift
  "$PY" -m pytest -q -p no:cacheprovider "$@" >"$LOGDIR/$name.log" 2>&1
  echo $? >"$LOGDIR/$name.rc"
  tail -n 1 "$LOGDIR/$name.log"
}

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  DEVICE=cuda
  echo "device_check: CUDA found; running the CUDA tests and the Triton tests on the GPU"
  run cuda tests -k "cuda or triton" -m "not server and not ray"
  run triton tests/triton_kernels --durations=10
else
  DEVICE=cpu
  echo "device_check: no CUDA device on this machine; running the Triton tests in the CPU interpreter only"
  run triton tests/triton_kernels --durations=10
fi

"$PY" - "$OUT" "$DEVICE" "$LOGDIR" <<'PYEOF'
import json, pathlib, platform, sys

import torch

out, device, logdir = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
try:
    import triton
    triton_version = triton.__version__
except ImportError as e:
    triton_version = f"not importable: {e}"
runs = {}
for rc in sorted(logdir.glob("*.rc")):
    log = rc.with_suffix(".log").read_text().splitlines()
    runs[rc.stem] = {"exit_code": int(rc.read_text()), "summary": log[-1] if log else ""}
report = {
    "device": device,
    "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
    "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
    "triton_interpreter": device != "cuda",
    "runs": runs,
    "gpu_figures": None,  # no GPU bench yet (docs/performance.md#gpus)
}
pathlib.Path(out).write_text(json.dumps(report, indent=2) + "\n")
print(f"device_check: wrote {out}")
sys.exit(max((r["exit_code"] for r in runs.values()), default=0))
PYEOF
