#!/usr/bin/env bash
# The core runner on a CUDA GPU: fp32, tf32, fp16, bf16 and bf16_pure on ResNet-18 with
# synthetic 32x32 data (no network, no files), then the sweep's report with every column
# (samples/s, peak memory, MFU, max batch, accuracy per mode); then `ampsweep capacity`: the
# largest batch of fp32, fp16 and bf16 searched beside its prediction; then fp32 and bf16 at two
# batch sizes: each step peak at the larger predicted from the smaller's run, against its own.
# Runs are recorded in outputs/mlflow.db of the folder it is run in (experiments gpu_check,
# gpu_check_capacity, gpu_check_memory).
#   scripts/gpu_check.sh                     # on a machine with a CUDA GPU
#   scripts/gpu_check.sh trainer.epochs=5    # extra Hydra overrides for every run
#   AMPSWEEP_DRYRUN=1 scripts/gpu_check.sh   # the same commands on the CPU, tiny (checks the
#                                            # script: fp32 and bf16 only, tf32 is CUDA-only)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
# $PYTHON when set (scripts/gpu_day.sh's venv), else the checkout's .venv, else python
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$repo/.venv/bin/python" ]; then PY=$repo/.venv/bin/python
else PY=python; fi
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's code, installed or not

modes=fp32,tf32,fp16,bf16,bf16_pure
size=(dataset.image_size=32 dataset.num_samples=16384 trainer.batch_size=256 trainer.epochs=3
      trainer.device=cuda trainer.timing_warmup_steps=10)
if [ "${AMPSWEEP_DRYRUN:-0}" = 1 ]; then
  modes=fp32,bf16
  # The dry run checks the commands, not the modes (the suite trains each): fp32 and bf16, as
  # the GPU day's table reads, on 8x8 images in batches of 4 (a CPU convolves slowly).
  size=(dataset.image_size=8 dataset.num_samples=40 trainer.batch_size=4 trainer.epochs=1
        trainer.max_steps=4 trainer.device=cpu trainer.timing_warmup_steps=1
        model.small_input_max_px=64)
  echo "gpu_check: DRY RUN on the CPU (tiny sizes; numbers mean nothing)"
fi

"$PY" -m ampsweep train -m "precision=$modes" model=resnet18 dataset=synthetic \
  dataset.channels=3 dataset.num_classes=10 "${size[@]}" \
  trainer.progress=false tracking.experiment=gpu_check "$@"
echo
"$PY" -m ampsweep report --experiment gpu_check --wide
echo

# The largest batch each mode fits on this GPU, found by trying (doubling, then bisecting,
# recovering from out-of-memory errors), beside the prediction from the activation bytes per
# sample and the batch-independent memory each measures: the target is a prediction within 15%
# of the measurement. The dry run only predicts, for a small budget (the search needs CUDA).
cap_modes=fp32,fp16,bf16
cap=(model=resnet18 dataset=synthetic dataset.image_size=32 dataset.channels=3
     dataset.num_classes=10 dataset.num_samples=1024 trainer.batch_size=256 trainer.device=cuda)
budget=()
if [ "${AMPSWEEP_DRYRUN:-0}" = 1 ]; then
  cap_modes=fp32,bf16
  cap=(model=resnet18 dataset=synthetic dataset.image_size=32 dataset.channels=3
       dataset.num_classes=10 dataset.num_samples=64 trainer.batch_size=8 trainer.device=cpu)
  budget=(--memory-budget 256MiB)
fi
"$PY" -m ampsweep capacity "${budget[@]}" "precision=$cap_modes" "${cap[@]}" \
  tracking.experiment=gpu_check_capacity
echo

# A training step's memory at a larger batch predicted from one run, against a run at that
# batch: the sweep's report says, per mode, "... step peak predicted from its batch-64 run:
# batch 256: predicted ..., measured ... (error %)" (docs/memory.md).
mem=(dataset.image_size=32 dataset.num_samples=1024 trainer.batch_size=64,256
     trainer.max_steps=10 trainer.device=cuda)
if [ "${AMPSWEEP_DRYRUN:-0}" = 1 ]; then
  mem=(dataset.image_size=8 dataset.num_samples=40 trainer.batch_size=4,8 trainer.max_steps=2
       trainer.device=cpu model.small_input_max_px=64)
fi
"$PY" -m ampsweep train -m precision=fp32,bf16 model=resnet18 dataset=synthetic \
  dataset.channels=3 dataset.num_classes=10 "${mem[@]}" trainer.progress=false \
  tracking.experiment=gpu_check_memory tracking.log_model=false
