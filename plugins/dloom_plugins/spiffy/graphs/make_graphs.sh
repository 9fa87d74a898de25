#!/usr/bin/env bash
# Recalibrate the built-in Spiffy draft graphs of toy-dllm (see README.md here).
# Usage: bash plugins/dloom_plugins/spiffy/graphs/make_graphs.sh   (from the repository root)
set -euo pipefail
out=plugins/dloom_plugins/spiffy/graphs
budget=${BUDGET:-10}
n=${N:-70}
score=${SCORE:-own}
for block in 32 8; do
    dloom calibrate --model toy-dllm --strategy quota --block-length "$block" --budget "$budget" \
        --score "$score" -n "$n" -o "$out/toy-dllm__quota__b$block.json"
    for tau in 0.7 0.9 0.99; do  # threshold's default, Fast-dLLM's threshold and the default before 0.7
        dloom calibrate --model toy-dllm --strategy threshold --param tau="$tau" --block-length "$block" \
            --budget "$budget" --score "$score" -n "$n" -o "$out/toy-dllm__threshold-${tau}__b$block.json"
    done
    dloom calibrate --model toy-dllm --strategy factor --param f=1.0 --block-length "$block" \
        --budget "$budget" --score "$score" -n "$n" -o "$out/toy-dllm__factor-1__b$block.json"
    for delta in 0 0.25 0.5 0.75 0.97; do  # the Fréchet certificate, the paper's default, frechet's default and two earlier ones
        dloom calibrate --model toy-dllm --strategy frechet --param delta="$delta" \
            --block-length "$block" --budget "$budget" --score "$score" -n "$n" \
            -o "$out/toy-dllm__frechet-${delta}__b$block.json"
    done
done
