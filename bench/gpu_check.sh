#!/usr/bin/env bash
# The GPU check, for a lent H100/H200 machine that has PyTorch and no network.
#
#   bench/gpu_check.sh --fetch-wheels   # here, with network: fill bench/wheels (outside git, ~30 MB)
#   bench/gpu_check.sh                  # there (run tool, carry bench/wheels): install, then check
#
# Installs our package and the dependencies torch does not bring from bench/wheels, then runs
# bench/gpu_check.py: extract and train in bf16 at hidden 4096 (random weights), tokens/s, MFU,
# the NVML reader on the real GPU, and every CUDA-only failure with its traceback. Under 8 minutes.
set -u
cd "$(dirname "$0")/.."
WHEELS=bench/wheels
NEEDED="transformers tokenizers safetensors huggingface_hub nvidia-ml-py psutil pyyaml regex filelock packaging tqdm requests fsspec hf-xet"
if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p "$WHEELS"
    for py in 3.10 3.11 3.12 3.13; do
        python -m pip download -q --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
            --python-version "$py" -d "$WHEELS" $NEEDED || echo "gpu_check: some wheels missing for python $py"
    done
    du -sh "$WHEELS"
    exit 0
fi
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
if [ -d "$WHEELS" ]; then
    python -m pip install -q --no-index --find-links "$WHEELS" $NEEDED 2>&1 | tail -3 || true
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 420 python bench/gpu_check.py --hidden 4096 --layers 4 --vocab 128256 --seq 2048 --tokens 16384 --steps 20 "$@"
echo "gpu_check.sh: exit $?"
