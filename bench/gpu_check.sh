#!/usr/bin/env bash
# The GPU check, for a lent H100/H200 machine that has PyTorch and no network.
#
#   bench/gpu_check.sh --fetch-wheels   # here, with network: fill bench/wheels and bench/_work/specforge (outside git)
#   bench/gpu_check.sh                  # there (run tool, carry bench/_work/specforge; bench/wheels only
#                                       # where the machine lacks a package): install, then check
#
# Installs our package and the dependencies torch does not bring from bench/wheels, then runs
# bench/gpu_check.py: extract and train in bf16 at hidden 4096 (random weights), tokens/s, MFU,
# the NVML reader on the real GPU, and every CUDA-only failure with its traceback; then, where
# SpecForge's wheel was unpacked in bench/_work/specforge, our trainer against SpecForge's at
# GPU size (bench/train_vs_specforge.py: its sdpa, then its default flex_attention). Under 9 minutes.
set -u
cd "$(dirname "$0")/.."
WHEELS=bench/wheels
NEEDED="transformers tokenizers safetensors huggingface_hub nvidia-ml-py psutil pyyaml regex filelock packaging tqdm requests fsspec hf-xet"
if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p "$WHEELS" bench/_work
    python -m pip download -q --no-deps -d bench/_work specforge==0.2.0 && rm -rf bench/_work/specforge \
        && python -m zipfile -e bench/_work/specforge-0.2.0-py3-none-any.whl bench/_work/specforge
    for py in 3.12; do  # the lent machines' python; the carry limit is 64 MiB
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
timeout 240 python bench/gpu_check.py --hidden 4096 --layers 4 --vocab 128256 --seq 2048 --tokens 16384 --steps 20 "$@"
echo "gpu_check.sh: exit $?"
if [ -d bench/_work/specforge ]; then
    for attention in sdpa flex_attention; do
        timeout 150 python bench/train_vs_specforge.py --specforge bench/_work/specforge --hidden 4096 --vocab 128256 \
            --draft-vocab 32000 --seq 2048 --batch 2 --steps 8 --rounds 3 --sf-attention "$attention"
        echo "train_vs_specforge ($attention): exit $?"
    done
fi
