#!/usr/bin/env bash
# The main job, end to end, on the bundled public-domain corpus (examples/corpus/), on CPU.
# Each step is the command a researcher would run on a cluster, only smaller.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${DEMO_OUTPUT:-demo_output}
CORPUS=examples/corpus/demo.jsonl.gz
TRAIN_ITERS=${DEMO_TRAIN_ITERS:-300}
SAS_EPOCHS=${DEMO_SAS_EPOCHS:-3}
FT_EPOCHS=${DEMO_FT_EPOCHS:-3}
FT_LR=${DEMO_FT_LR:-1e-3}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}
mkdir -p "$OUT"

echo "== 1/7 train a sentencepiece tokenizer on $CORPUS"
$PY tools/train_tokenizer.py --input "$CORPUS" --model-prefix "$OUT/tokenizer" \
    --vocab-size 4000 --split-sentences

echo "== 2/7 preprocess into a Megatron indexed dataset (2 workers)"
$PY tools/preprocess_data.py --input "$CORPUS" --tokenizer-model "$OUT/tokenizer.model" \
    --output-prefix "$OUT/demo" --split-sentences --workers 2

echo "== 3/7 build train/valid/test samples"
$PY tools/build_samples.py --data-path "$OUT/demo_text_sentence" \
    --tokenizer-model "$OUT/tokenizer.model" --seq-length 128 --split 90,5,5 \
    --train-samples $((TRAIN_ITERS * 16)) --valid-samples 256 --test-samples 64 \
    --data-cache-path "$OUT/cache"

echo "== 4/7 pretrain a small TACO (MLM + MPM) with DeepSpeed on 2 CPU ranks"
rm -rf "$OUT/taco"
.venv/bin/deepspeed --num_gpus 2 pretrain_taco.py \
    --model-size small --tensor-model-parallel-size 1 \
    --deepspeed-config ds_configs/zero1_fp32.json \
    --data-path "$OUT/demo_text_sentence" --tokenizer-model "$OUT/tokenizer.model" \
    --data-cache-path "$OUT/cache" --split 90,5,5 --seq-length 128 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "$TRAIN_ITERS" \
    --lr 1e-3 --lr-warmup-iters 30 --min-lr 1e-5 --weight-decay 0.01 \
    --log-interval 10 --eval-interval 100 --eval-iters 4 \
    --save "$OUT/taco/checkpoints" --save-interval 100 \
    --tensorboard-dir "$OUT/taco/tensorboard"

echo "== 5/7 pretrain a small SAS (MLM + lambda RTD) for $SAS_EPOCHS epochs: cold start, then self-augmentation"
# SAS-small's width (Table 5) at 4 layers so that 3 epochs take a few minutes on 2 cores.
rm -rf "$OUT/sas"
.venv/bin/deepspeed --num_gpus 2 pretrain_sas.py \
    --model-size small --num-layers 4 --deepspeed-config ds_configs/zero1_fp32.json \
    --data-path "$OUT/demo_text_sentence" --tokenizer-model "$OUT/tokenizer.model" \
    --data-cache-path "$OUT/cache" --split 90,5,5 --seq-length 128 \
    --micro-batch-size 16 --global-batch-size 32 --train-epochs "$SAS_EPOCHS" \
    --lr 1e-3 --lr-warmup-iters 20 --min-lr 1e-5 --weight-decay 0.01 \
    --log-interval 10 --eval-interval 100 --eval-iters 4 \
    --save "$OUT/sas/checkpoints" --save-interval 100 \
    --tensorboard-dir "$OUT/sas/tensorboard"

echo "== 6/7 a synthetic downstream task from held-out text: original sentence vs its words shuffled"
# (--corruption swap, two adjacent words exchanged, stays at chance for every encoder here.)
$PY examples/make_word_order_task.py --data-path "$OUT/demo_text_sentence" \
    --tokenizer-model "$OUT/tokenizer.model" --split 90,5,5 --output "$OUT/word_order" \
    --corruption shuffle

echo "== 7/7 fine-tune both pretrained encoders on it, and the same heads on random encoders"
rm -rf "$OUT/finetune"
for model in taco sas; do
    for init in pretrained random; do
        extra=()
        [[ $init == random ]] && extra=(--random-init)
        .venv/bin/deepspeed --num_gpus 2 tools/finetune.py \
            --load "$OUT/$model/checkpoints" --task custom --data-dir "$OUT/word_order" \
            --output "$OUT/finetune/${model}_$init" "${extra[@]}" \
            --deepspeed-config ds_configs/zero1_fp32.json --seq-length 128 \
            --micro-batch-size 16 --global-batch-size 32 --epochs "$FT_EPOCHS" \
            --lr "$FT_LR" --log-interval 10 --num-workers 1
    done
done
$PY examples/print_demo_scores.py "$OUT/finetune"

echo "== done: loss curves in $OUT/taco/tensorboard/loss_curve.png and $OUT/sas/tensorboard/loss_curve.png"
echo "   (metrics.jsonl beside each), checkpoints in $OUT/taco/checkpoints and $OUT/sas/checkpoints;"
echo "   fine-tuning runs (results.json, loss_curve.png) in $OUT/finetune/"
