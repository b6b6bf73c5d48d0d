#!/usr/bin/env bash
# One-shot GPU check for a single GPU (sized for an H200): hardware, kernel tests on the GPU, greedy parity
# with HF generate, the engine's own throughput with host ms per step, the GPU's idle share and the share of
# the H200's roofline (nano-vllm's shape on a random 8B and 0.6B, labeling with choices over a shared
# instruction on a 1B), output throughput of batchq vs HF generate vs HF continuous batching on a random 8B
# Llama (batch-invariant, the default, and batch_invariant = false), a random 1B kept 4-bit, and bitwise batch
# invariance on a tiny model (dense and 4-bit). No network needed; ends within ~9 minutes; results in
# $OUT/gpu_check.json and the kernel tests' whole log in $OUT/kernels.log. An image with only torch,
# Triton and transformers also needs (as wheels, say): pydantic, pydantic-core, annotated-types,
# typing-inspection, typing-extensions, orjson, redis, PyJWT, hiredis, arq, llguidance, gguf, jsonschema
# (+ referencing, rpds-py, jsonschema-specifications), pytest, pytest-asyncio and pytest-xdist.
#
#   bash benchmarks/gpu_check.sh            # from the repo root (or anywhere: it cds there)
#   bash benchmarks/gpu_check.sh --tiny     # CPU dry run of the same flow with tiny models
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repo itself, no pip install needed
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# $PYTHON if given, else the first of python3 / .venv/bin/python whose torch sees a GPU (--tiny: any torch).
want='import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'
case " $* " in *" --tiny "*) want='import torch' ;; esac
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for cand in python3 .venv/bin/python; do
        if command -v "$cand" >/dev/null && "$cand" -c "$want" 2>/dev/null; then PY=$cand; break; fi
    done
    PY=${PY:-python3}
fi

echo "== $(date -u +%FT%TZ) $(uname -n) python=$PY"
nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

if ! "$PY" -c "import torch, transformers, triton, pydantic, orjson, pytest" 2>/dev/null; then
    echo "gpu_check: needs torch (CUDA build), transformers, triton, pydantic, orjson and pytest importable by $PY" >&2
    "$PY" -c "import torch, transformers, triton, pydantic, orjson, pytest" 2>&1 | tail -1 >&2
    exit 2
fi
case " $* " in
*" --tiny "*) ;;
*)
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: torch.cuda.is_available() is False (torch $("$PY" -c 'import torch; print(torch.__version__)')); use --tiny for a CPU dry run" >&2
        exit 2
    fi
    ;;
esac
# Hard stop at 9 minutes whatever happens inside; the stages have their own budgets.
exec timeout -k 10 540 "$PY" benchmarks/gpu_check.py "$@"
