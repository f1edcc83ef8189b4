#!/usr/bin/env bash
# Speed on a GPU, honestly measured: experiment=precision_sweep_gpu on ResNet-50 with
# synthetic 224x224 images and on a ViT-B/16-sized VisionTransformer, channels_last, with and
# without torch.compile; experiment=precision_sweep_lm on a GPT-2-small-sized GPT and a
# Llama-shaped Hugging Face model (fp32 and bf16, compiled); then the report of each sweep with
# every column (samples/s, step time, TFLOPS, MFU against the GPU's datasheet peak for the
# mode's dtype, memory), against fp32 and against tf32. Then fp8_tensorwise and fp8_rowwise
# against bf16 on the ViT, compiled (needs pip install -e '.[fp8]'). No network needed.
# Runs are recorded in outputs/mlflow.db of the folder it is run in.
#   scripts/gpu_bench.sh                     # on a machine with a CUDA GPU (H200: ~10 min)
#   scripts/gpu_bench.sh trainer.max_steps=30   # extra Hydra overrides for every run
#   scripts/gpu_bench.sh --headline          # what the headline figures need: ResNet-50
#                                            # uncompiled; bf16 and fp8_tensorwise on the ViT
#   scripts/gpu_bench.sh --fsdp              # only the FSDP run of the GPT (2+ GPUs)
#   AMPSWEEP_DRYRUN=1 scripts/gpu_bench.sh   # the same commands on the CPU, tiny and uncompiled
# With two or more GPUs, every form (but --headline's dry run) also trains the GPT under FSDP
# (trainer.strategy=fsdp, one rank per GPU) in bf16, gathering bf16 and reducing in fp32 and
# in bf16: what the reduction's precision costs in perplexity and buys in speed.
# Published anchor: NVIDIA's ResNet-50 v1.5 on one A100 trains at 938 img/s in TF32 and
# 2470 img/s with AMP (2.63x). The targets on an H200 (AMP against TF32 and fp32 on resnet50,
# bf16 MFU of the compiled ViT, fp8 against bf16) are in the table scripts/gpu_day.sh prints.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
# $PYTHON when set (scripts/gpu_day.sh's venv), else the checkout's .venv, else python
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$repo/.venv/bin/python" ]; then PY=$repo/.venv/bin/python
else PY=python; fi
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"

models="resnet50 vit gpt llama"
modes=fp32,tf32,fp16,bf16
compile=false,true
fp8_modes=bf16,fp8_tensorwise,fp8_rowwise
fsdp_only=false
headline=false
if [ "${1:-}" = --fsdp ]; then
  shift
  fsdp_only=true
  models=""
fi
if [ "${1:-}" = --headline ]; then
  headline=true
  # AMP against TF32 and fp32 is a ratio of uncompiled ResNet-50 runs, and the ViT's bf16 MFU
  # comes from the compiled bf16 run of the fp8 sweep: two of the full script's 15 compiles,
  # each of which takes longer than the 60 steps it times.
  shift
  models=resnet50
  compile=false
  fp8_modes=bf16,fp8_tensorwise
fi
# Timing: 10 warm-up steps (compilation, cuDNN autotuning) then the median of the rest.
# Diagnostics off: their fp32 reference pass would land inside timed steps.
common=(trainer.device=cuda trainer.epochs=1000 trainer.max_steps=60 trainer.timing_warmup_steps=10
        trainer.eval_every=1000 trainer.channels_last=true diagnostics.every=0 trainer.progress=false)
r50=(model=resnet50 dataset.image_size=224 dataset.num_samples=2560 trainer.batch_size=256)
vit=(model=vit dataset.image_size=224 dataset.num_samples=2560 trainer.batch_size=128
     model.patch_size=16 model.hidden_dim=768 model.num_layers=12 model.num_heads=12
     model.mlp_dim=3072)
# Language models on the standard library's source (experiment=precision_sweep_lm), in fp32
# and bf16 with torch.compile: a GPT-2-small-sized GPT, and a Llama-shaped Hugging Face model
# (needs the hf extra; the experiment's GPT size keys are dropped), sequences of 1024 tokens.
lm_modes=fp32,bf16
lm_compile=true
gpt=(model=gpt model.n_layer=12 model.n_head=12 model.n_embd=768 model.block_size=1024
     dataset.seq_len=1024 dataset.max_bytes=4000000 trainer.batch_size=16)
llama=(model=hf_causal_lm ~model.n_layer ~model.n_head ~model.n_embd ~model.block_size
       model.arch=llama model.hidden_size=1024 model.num_hidden_layers=8
       model.num_attention_heads=16 dataset.seq_len=1024 dataset.max_bytes=4000000
       trainer.batch_size=16)
if [ "${AMPSWEEP_DRYRUN:-0}" = 1 ]; then
  modes=fp32,bf16
  compile=false
  common=(trainer.device=cpu trainer.epochs=1000 trainer.max_steps=3 trainer.timing_warmup_steps=1
          trainer.eval_every=1000 trainer.channels_last=true diagnostics.every=0 trainer.progress=false)
  r50=(model=resnet50 dataset.image_size=8 dataset.num_samples=64 trainer.batch_size=8)
  vit=(model=vit dataset.image_size=32 dataset.num_samples=64 trainer.batch_size=8
       model.patch_size=16 model.hidden_dim=32 model.num_layers=1 model.num_heads=2 model.mlp_dim=64)
  lm_compile=false
  gpt=(model=gpt model.n_layer=1 model.n_head=2 model.n_embd=32 model.block_size=32
       dataset.seq_len=32 dataset.max_bytes=20000 trainer.batch_size=4)
  llama=(model=hf_causal_lm ~model.n_layer ~model.n_head ~model.n_embd ~model.block_size
         model.arch=llama model.hidden_size=32 model.num_hidden_layers=1
         model.num_attention_heads=2 dataset.seq_len=32 dataset.max_bytes=20000 trainer.batch_size=4)
  echo "gpu_bench: DRY RUN on the CPU (tiny sizes, no compile; numbers mean nothing)"
fi

status=0
for name in $models; do
  experiment=precision_sweep_gpu; mode_list=$modes; compiled=$compile
  case "$name" in
    resnet50) args=("${r50[@]}") ;;
    vit) args=("${vit[@]}") ;;
    gpt) args=("${gpt[@]}"); experiment=precision_sweep_lm; mode_list=$lm_modes; compiled=$lm_compile ;;
    llama) args=("${llama[@]}"); experiment=precision_sweep_lm; mode_list=$lm_modes; compiled=$lm_compile ;;
  esac
  exp="gpu_bench_$name"
  echo "=== $name: precision=$mode_list trainer.compile=$compiled"
  "$PY" -m ampsweep train -m "experiment=$experiment" "precision=$mode_list" \
    "trainer.compile=$compiled" "${common[@]}" "${args[@]}" "tracking.experiment=$exp" "$@" \
    || status=$?
  echo
  "$PY" -m ampsweep report --experiment "$exp" --wide || status=$?
  echo
  if [[ ",$mode_list," == *,tf32,* ]]; then  # against tf32 where it ran (not on a CPU)
    "$PY" -m ampsweep report --experiment "$exp" --wide --baseline tf32 || status=$?
    echo
  fi
done

# FSDP2 (trainer.strategy=fsdp) on the GPT in bf16, one rank per GPU, with bf16 gathers and
# fp32 against bf16 gradient reduction (precision.fsdp.reduce_dtype), uncompiled; every rank's
# processes are started by the ampsweep_local launcher. FSDP needs two ranks or more: on a
# machine with one GPU it is skipped (said so). The dry run trains two Gloo ranks on the CPU.
fsdp_ranks=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${AMPSWEEP_DRYRUN:-0}" = 1 ]; then fsdp_ranks=2; fi
if [ "${AMPSWEEP_DRYRUN:-0}" = 1 ] && [ "$headline" = true ]; then
  echo "=== gpt under FSDP: left out of --headline's dry run (AMPSWEEP_DRYRUN=1 $0 --fsdp runs it)"
elif [ "$fsdp_ranks" -lt 2 ]; then
  echo "=== gpt under FSDP: skipped, it shards over two or more GPUs and this machine has $fsdp_ranks"
else
  echo "=== gpt under FSDP on $fsdp_ranks ranks: precision=bf16 precision.fsdp.reduce_dtype=fp32,bf16"
  "$PY" -m ampsweep train -m hydra/launcher=ampsweep_local experiment=precision_sweep_lm \
    precision=bf16 precision.fsdp.reduce_dtype=fp32,bf16 trainer.strategy=fsdp \
    "trainer.nproc=$fsdp_ranks" trainer.compile=false "${common[@]}" "${gpt[@]}" \
    tracking.experiment=gpu_bench_gpt_fsdp "$@" || status=$?
  echo
  "$PY" -m ampsweep report --experiment gpu_bench_gpt_fsdp --wide --baseline bf16 || status=$?
  echo
fi
if [ "$fsdp_only" = true ]; then exit "$status"; fi

# fp8 (torchao's float8 training of the ViT's eligible Linear layers) against bf16, compiled, as
# fp8 is meant to run: what fp8 tensor cores buy (compute capability 8.9+). In the dry run,
# torchao's emulation (no compile: the emulation does not compile); its speed means nothing.
fp8_args=(trainer.compile=true)
if [ "${AMPSWEEP_DRYRUN:-0}" = 1 ]; then
  fp8_args=(trainer.compile=false precision.fp8.emulate=true)
fi
echo "=== vit: precision=$fp8_modes ${fp8_args[*]}"
"$PY" -m ampsweep train -m experiment=precision_sweep_gpu "precision=$fp8_modes" \
  "${fp8_args[@]}" "${common[@]}" "${vit[@]}" tracking.experiment=gpu_bench_vit_fp8 "$@" \
  || status=$?
echo
"$PY" -m ampsweep report --experiment gpu_bench_vit_fp8 --wide --baseline bf16 || status=$?
exit "$status"
