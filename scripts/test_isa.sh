#!/usr/bin/env bash
# The fast test suite under the instruction sets that other x86 CPUs give PyTorch and its libraries, emulated on this
# one, so that a tolerance that holds only for this CPU's kernels fails here rather than on someone else's machine.
#
#   scripts/test_isa.sh                       # every setting this CPU can run, one line each; exit 1 if any failed
#   scripts/test_isa.sh tests/test_modeling.py  # extra arguments go to pytest (default: -m "not slow")
#
# Run it inside the activated virtual environment (README: "Set up and run the tests"). Each setting takes as long as
# one fast-suite run (1.5-3 minutes on 2 cores); its full pytest output is kept in a log file, named on its line.
#
# What each variable changes (checked with `python -c "import torch; print(torch.backends.cpu.get_cpu_capability())"`,
# ONEDNN_VERBOSE=1 and MKL_VERBOSE=1):
#   ATEN_CPU_CAPABILITY   PyTorch's own vectorised kernels (log_softmax, exp, reductions, the bf16 matmul fallback,
#                         even torch.randn): default (scalar), avx2, avx512. A value above what the CPU has is NOT
#                         refused: avx512 on an AVX2 CPU dies of an illegal instruction, so it is set only where the
#                         CPU has the instructions.
#   ONEDNN_MAX_CPU_ISA    caps oneDNN (the bf16 linear layers of the sampler, convolutions) below what the CPU has:
#                         SSE41, AVX, AVX2, AVX512_CORE, AVX512_CORE_AMX, ...; it cannot raise it.
#   MKL_CBWR=COMPATIBLE   MKL's fp32 matrix products (every nn.Linear in fp32) on its portable code path, summed in
#                         another order; MKL_ENABLE_INSTRUCTIONS did not change MKL's results on the AMD CPU this was
#                         written on, so the emulation uses CBWR.
# The default row is the CPU's own choice (on an AMX Xeon: AVX-512 in ATen, AMX in oneDNN, AVX-512 in MKL).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ $# -eq 0 ]; then
  set -- -m "not slow"
fi

flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }

settings=("")  # the CPU's own choice
if has avx2 && has fma; then
  settings+=("ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2")
fi
if has avx512f && has avx512bw && has avx512vl && has avx512dq; then
  settings+=("ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512")  # AVX-512 without AMX / VNNI / bf16
fi
settings+=("ONEDNN_MAX_CPU_ISA=AVX ATEN_CPU_CAPABILITY=default"
           "ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE")

logs=$(mktemp -d "${TMPDIR:-/tmp}/test_isa.XXXXXX")
failed=0
for setting in "${settings[@]}"; do
  name=${setting:-default}
  log="$logs/$(echo "${setting:-default}" | tr ' =' '_-').log"
  start=$(date +%s)
  # shellcheck disable=SC2086  # the setting is a list of VAR=value words
  env $setting python -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
  status=$?
  seconds=$(( $(date +%s) - start ))
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran' "$log" | tail -1 | tr -d '=')
  capability=$(env $setting python -c "import torch; print(torch.backends.cpu.get_cpu_capability())" 2>/dev/null)
  if [ $status -eq 0 ]; then
    result=passed
  else
    result=FAILED
    failed=1
  fi
  echo "$result  [$name] (ATen ${capability:-?}) ${summary# } in ${seconds}s  log: $log"
done
exit $failed
