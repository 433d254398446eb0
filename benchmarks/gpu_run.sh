#!/usr/bin/env bash
# The GPU checks as one prepared run (a lent GPU machine is held minutes, not hours): which
# transport pull's READs of CUDA memory take, the VRAM tests (the device fence among them), and
# `kvfsm bench --memory vram` (a2 and b) at 1, 8 and 64 MiB a request, push and pull, 4 and 32
# in flight, and LBHNC against BLHNC at 8 MiB. Results go to
# $OUT: results.jsonl (one bench report a line), log.txt, vram_tests.txt, proto_*.txt.
# Wheels in .whl/ (nixl-cu13, nixl, msgspec, transitions, pyzmq) are installed first if present.
set -u
OUT=${OUT:-/tmp/kvfsm-gpu}
BUDGET_S=${BUDGET_S:-400}  # no step starts after this many seconds (a lease has 15 minutes)
mkdir -p "$OUT"
start=$(date +%s)
log() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$OUT/log.txt"; }
late() { [ $(($(date +%s) - start)) -ge "$BUDGET_S" ]; }

export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi -L >>"$OUT/log.txt" 2>&1
python3 -c "import torch, nixl; print('torch', torch.__version__, torch.cuda.get_device_name())" \
    >>"$OUT/log.txt" 2>&1

# bench NAME TIMEOUT ARGS...: one `kvfsm bench --json` run, its report appended to results.jsonl.
bench() {
    local name=$1 limit=$2
    shift 2
    if late; then log "skipped $name (budget)"; return; fi
    log "bench $name: $*"
    timeout "$limit" python3 -m kvfsm.cli bench --memory vram --regions 32 --block-kib 32 \
        --repeat 2 --control-total 0 --variants raw engine --json "$@" \
        >"/tmp/$name.out" 2>"/tmp/$name.err"
    local rc=$? line
    line=$(grep '^{' "/tmp/$name.out" | tail -1)
    echo "{\"name\": \"$name\", \"rc\": $rc, \"report\": ${line:-null}}" >>"$OUT/results.jsonl"
    log "done $name rc=$rc"
    tail -5 "/tmp/$name.err" >>"$OUT/log.txt"
}

# 1. READs of CUDA memory: UCX's own choice (n) against kvfsm's default (y), with UCX's
#    protocol report, 8 MiB a request.
for get in n y; do
    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=$get UCX_PROTO_INFO=y bench "probe_pull_get_$get" 120 \
        --mode pull --blocks 512 --blocks-per-request 8 --requests 64 --inflight 4 --repeat 1
    grep -i -E "get|cuda_ipc|tcp" "/tmp/probe_pull_get_$get.out" | head -80 >"$OUT/proto_$get.txt"
done

# 2. The VRAM tests.
log "tests/fabric/test_vram.py"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/fabric/test_vram.py \
    tests/runtime/test_integrity.py -k "vram or gpu" >"$OUT/vram_tests.txt" 2>&1
log "vram tests rc=$?"
# vLLM's own layouts on VRAM, where vLLM is installed (it is too large to carry in a call).
if python3 -c "import vllm" 2>/dev/null; then
    timeout 180 python3 -m pytest -q -p no:cacheprovider tests/vllm_connector/test_layouts_nixl.py -k cuda \
        >"$OUT/vram_layouts.txt" 2>&1
    log "vram layout tests rc=$?"
else
    log "vram layout tests skipped: no vllm here"
fi

# 3. The bench at three sizes, push and pull. On an H100 (2026-11-27) one round of a2 and b at
#    one number in flight took 12-25 s (fresh processes, CUDA contexts, the byte check): 8 MiB
#    at 2 rounds x 2 numbers in flight ~110 s, 64 MiB at 1 round ~100 s, 1 MiB at 1 round ~50 s.
bench push_8 150 --mode push --blocks 512 --blocks-per-request 8 --requests 64 --inflight 4 32
bench pull_8 150 --mode pull --blocks 512 --blocks-per-request 8 --requests 64 --inflight 4 32
bench push_64 150 --mode push --blocks 2048 --blocks-per-request 64 --requests 32 --inflight 4 32 \
    --repeat 1
bench pull_64 150 --mode pull --blocks 2048 --blocks-per-request 64 --requests 32 --inflight 4 32 \
    --repeat 1
bench push_1 90 --mode push --blocks 64 --blocks-per-request 1 --requests 64 --inflight 4 32 \
    --repeat 1
bench pull_1 90 --mode pull --blocks 64 --blocks-per-request 1 --requests 64 --inflight 4 32 \
    --repeat 1
# 4. vLLM's block-outermost layout on the device: one row per block against one per layer.
bench layout_lbhnc_8 150 --mode push --layout LBHNC --blocks 512 --blocks-per-request 8 \
    --requests 64 --inflight 4 --repeat 1
bench layout_blhnc_8 150 --mode push --layout BLHNC --blocks 512 --blocks-per-request 8 \
    --requests 64 --inflight 4 --repeat 1
# 5. Host memory on the same machine, for the like-for-like gap at 1 MiB.
bench dram_push_1 120 --memory dram --mode push --blocks 64 --blocks-per-request 1 \
    --requests 64 --inflight 1 4
# 6. The cost of verify=all on the device (checksums taken by torch on the GPU): v/b.
bench verify_push_8 150 --mode push --verify --variants raw engine --blocks 512 \
    --blocks-per-request 8 --requests 64 --inflight 4 --repeat 1
bench verify_pull_64 150 --mode pull --verify --variants raw engine --blocks 2048 \
    --blocks-per-request 64 --requests 32 --inflight 4 --repeat 1
log "finished"
