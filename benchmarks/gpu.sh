#!/bin/bash
# The checks of a lent GPU machine, in the calls the device tool allows (10 minutes each), from the
# repository root, with the machine's own python3 (its torch and Triton) and fastoptim from this tree
# (the native library built here travels with it: carry fastoptim/_C.abi3.so). Logs go to $OUT.
#   bash benchmarks/gpu.sh tests   the Triton tests on CUDA tensors, then the CPU suites' steps on the GPU
#   bash benchmarks/gpu.sh bench   host time, `fastoptim bench --device cuda`, and compiled against eager
#   bash benchmarks/gpu.sh quick   one call of about 7 minutes: the Triton, release, master-bits and Muon tests on CUDA,
#                                  host time, and `fastoptim bench` on GPT-2 124M (fp32 and bf16 rows)
#   bash benchmarks/gpu.sh profile where the host time of a CUDA step goes (Adan, AdamW) and Muon's time on GPT-2 124M
#   bash benchmarks/gpu.sh lean    master remainders on CUDA (tests and GPT-2 124M in bf16), Muon batched by shape
#   bash benchmarks/gpu.sh suite   the whole suite's steps on the GPU (FASTOPTIM_TEST_DEVICE=cuda, but the distributed,
#                                  sanitizer, set-up, bench and train tests), its verdicts per test in suite-on-cuda.log
#                                  (written as they come, so a run cut short keeps them) and failures counted per file
#   bash benchmarks/gpu.sh formats host time, then every lean format's step on GPT-2 124M (fp32 and bf16 params) against
#                                  torch's fused AdamW, and Muon's engines against torch.optim.Muon
#   bash benchmarks/gpu.sh compile the compile tests with the machine's torch, and the code inductor makes of
#                                  a CUDA step (output-code.log: what the op's mutated tensors cost)
#   bash benchmarks/gpu.sh cpu     the CPU suite on the machine's cores (14 workers: a quick gate), then the
#                                  Triton tests on CUDA tensors
#   bash benchmarks/gpu.sh host    host time, CPU and CUDA, of this tree and of $BEFORE (another tree, with its own
#                                  native library), in turns, on the same machine
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTHONDONTWRITEBYTECODE=1
python3 - <<'PY' 2>&1 | tee "$OUT/facts.txt"
import torch, triton
import fastoptim
from fastoptim.engines.backends import cpu as cpu_backend
from fastoptim.measure import cpu_features
print(f"torch {torch.__version__}, Triton {triton.__version__}, {torch.cuda.get_device_name()}, "
      f"native library loaded: {cpu_backend.AVAILABLE}, CPU features: {' '.join(cpu_features())}")
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/facts.txt"
# where the host time of a step of fastoptim.$1 on 148 tiny CUDA params goes
host_profile() {
    timeout 60 python3 -c "
import cProfile, pstats, torch, fastoptim
params = [torch.nn.Parameter(torch.randn(16, device='cuda')) for _ in range(148)]
for p in params: p.grad = torch.randn_like(p)
opt = fastoptim.$1(params, lr=1e-3)
for _ in range(5): opt.step()
cProfile.run('for _ in range(100): opt.step()', '/tmp/profile')
pstats.Stats('/tmp/profile').sort_stats('tottime').print_stats(25)"
}
case "${1:-tests}" in
tests)
    timeout 170 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 120 tests/test_triton.py -k "cuda" -rfE 2>&1 \
        | tee "$OUT/triton-cuda.log" | tail -30
    FASTOPTIM_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider -n 12 --timeout 120 -rfE \
        tests/test_triton.py tests/test_fused.py tests/test_compile.py 2>&1 | tee "$OUT/suites-on-cuda.log" | tail -40
    ;;
bench)
    timeout 120 python3 -m benchmarks.host_time --device cuda --steps 20 --repeats 5 2>&1 | tee "$OUT/host-time.md"
    host_profile Adan > "$OUT/profile.txt" 2>&1
    # no torch.compile'd Adan here: its first call takes minutes per model on this machine
    timeout 330 python3 -m fastoptim.cli bench --device cuda --models gpt2-124m llama-60m small-tensors \
        --optimizers torch-adam-foreach torch-adam-fused torch-adamw-foreach torch-adamw-fused \
        timm-adan adan-foreach adan-fused-single adan-fused-multi adamw-fused-multi adan-sn-fused-multi \
        adamwsn-fused-multi adan-8bit-fused-multi adamw-8bit-fused-multi --out "$OUT/bench" 2>&1 | tr '\r' '\n' | grep -v "step/s\]"
    timeout 100 python3 -m benchmarks.dispatch --device cuda --models "GPT-2 124M" --steps 20 2>&1 \
        | tee "$OUT/dispatch.md"
    ;;
quick)
    timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 90 tests/test_triton.py -k "cuda" -rfE 2>&1 \
        | tee "$OUT/triton-cuda.log" | tail -15
    FASTOPTIM_TEST_DEVICE=cuda timeout 130 python3 -m pytest -q -p no:cacheprovider -n 12 --timeout 90 -rfE \
        tests/test_release.py tests/test_master_bits.py tests/test_muon.py 2>&1 | tee "$OUT/lean-on-cuda.log" | tail -25
    timeout 70 python3 -m benchmarks.host_time --device cuda --steps 20 --repeats 5 2>&1 | tee "$OUT/host-time.md"
    timeout 80 python3 -m fastoptim.cli bench --device cuda --models gpt2-124m --optimizers torch-adamw-fused \
        adan-fused-multi adamw-fused-multi adamwsn-fused-multi adamw-8bit-fused-multi muon-fused-multi torch-muon \
        --out "$OUT/fp32" 2>&1 | tr '\r' '\n' | grep -v "step/s\]"
    timeout 60 python3 -m fastoptim.cli bench --device cuda --dtype bf16 --models gpt2-124m --optimizers \
        torch-adamw-fused adamw-fused-multi adamw-master32-fused-multi --out "$OUT/bf16" 2>&1 | tr '\r' '\n' \
        | grep -v "step/s\]"
    ;;
profile)
    host_profile Adan > "$OUT/profile-adan.txt" 2>&1
    host_profile AdamW > "$OUT/profile-adamw.txt" 2>&1
    timeout 150 python3 -m benchmarks.muon --device cuda --model gpt2-124m 2>&1 | tee "$OUT/muon.md"
    ;;
lean)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 90 -rfE tests/test_triton.py \
        tests/test_master_bits.py -k "cuda" 2>&1 | tee "$OUT/lean-tests.log" | tail -15
    timeout 90 python3 -m fastoptim.cli bench --device cuda --dtype bf16 --models gpt2-124m --optimizers \
        torch-adamw-fused adamw-fused-multi adamw-master24-fused-multi adamw-master32-fused-multi \
        adamw-8bit-fused-multi adamwsn-8bit-master24-fused-multi --out "$OUT/bf16" 2>&1 | tr '\r' '\n' \
        | grep -v "step/s\]" | grep -v "^gpt2-124m: "
    timeout 80 python3 -m benchmarks.muon --device cuda --model gpt2-124m 2>&1 | tee "$OUT/muon.md"
    ;;
suite)  # test_triton.py's CUDA tests included
    FASTOPTIM_TEST_DEVICE=cuda timeout "${SUITE_SECONDS:-300}" python3 -m pytest -v -p no:cacheprovider -n 14 \
        --timeout 90 -m "not distributed and not sanitizers" --ignore tests/test_distributed.py \
        --ignore tests/test_sanitizers.py --ignore tests/test_setup.py --ignore tests/test_bench.py \
        --ignore tests/test_train.py tests > "$OUT/suite-on-cuda.log" 2>&1
    grep -oE "(PASSED|FAILED|ERROR|SKIPPED|XFAIL)[^:]*tests/test_[a-z0-9_]+\.py" "$OUT/suite-on-cuda.log" \
        | sed -E 's/ .*tests\// /' | sort | uniq -c | sort -k2,3 | tee "$OUT/suite-counts.txt"
    grep -E "^(FAILED|ERROR) " "$OUT/suite-on-cuda.log" | cut -c1-400 | head -150 > "$OUT/suite-failures.txt"
    tail -3 "$OUT/suite-on-cuda.log"
    ;;
formats)
    timeout 70 python3 -m benchmarks.host_time --device cuda --steps 20 --repeats 5 2>&1 | tee "$OUT/host-time.md"
    timeout 90 python3 -m fastoptim.cli bench --device cuda --models gpt2-124m --repeats 3 --optimizers \
        torch-adamw-fused adamw-fused-multi adan-fused-multi adamw-8bit-fused-multi adamwsn-fused-multi \
        adan-sn-fused-multi --out "$OUT/fp32" 2>&1 | tr '\r' '\n' | grep -v "step/s\]" | grep -v "^gpt2-124m: "
    timeout 90 python3 -m fastoptim.cli bench --device cuda --dtype bf16 --models gpt2-124m --repeats 3 --optimizers \
        torch-adamw-fused adamw-fused-multi adamw-8bit-fused-multi adamw-master24-fused-multi \
        adamwsn-8bit-master24-fused-multi --out "$OUT/bf16" 2>&1 | tr '\r' '\n' | grep -v "step/s\]" \
        | grep -v "^gpt2-124m: "
    timeout 80 python3 -m benchmarks.muon --device cuda --model gpt2-124m 2>&1 | tee "$OUT/muon.md"
    ;;
cpu)
    timeout "${SUITE_SECONDS:-270}" python3 -m pytest -q -p no:cacheprovider -n 14 --timeout 150 -rfE \
        -m "not distributed and not sanitizers" --ignore tests/test_distributed.py --ignore tests/test_sanitizers.py \
        --ignore tests/test_setup.py --ignore tests/test_bench.py --ignore tests/test_train.py tests \
        > "$OUT/cpu-suite.log" 2>&1
    tail -3 "$OUT/cpu-suite.log"; grep -E "^(FAILED|ERROR) " "$OUT/cpu-suite.log" | cut -c1-300 | head -60
    timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 90 tests/test_triton.py -k "cuda" -rfE 2>&1 \
        | tee "$OUT/triton-cuda.log" | tail -8
    ;;
host)
    for tree in "$BEFORE" .; do
        (cd "$tree" && PYTHONPATH=$PWD timeout 120 python3 -m benchmarks.host_time --steps 20 --repeats 5) \
            > "$OUT/host-cpu-$(basename "$(realpath "$tree")").md" 2>&1
        (cd "$tree" && PYTHONPATH=$PWD timeout 90 python3 -m benchmarks.host_time --device cuda --steps 20 \
            --repeats 5) > "$OUT/host-cuda-$(basename "$(realpath "$tree")").md" 2>&1
    done
    ;;
compile)
    timeout 140 python3 -m pytest -q -p no:cacheprovider -n 14 --timeout 120 -rfE tests/test_compile.py 2>&1 \
        | tee "$OUT/compile-tests.log" | tail -30
    TORCH_LOGS=output_code timeout 70 python3 -c "
import torch, fastoptim
params = [torch.nn.Parameter(torch.randn(256, 256, device='cuda')) for _ in range(3)]
for p in params: p.grad = torch.randn_like(p)
opt = fastoptim.Adan(params, lr=torch.tensor(1e-3, device='cuda'), weight_decay=0.02)
step = torch.compile(opt.step, fullgraph=True)
step(); step()" > "$OUT/output-code.log" 2>&1
    grep -c "clone\|copy_" "$OUT/output-code.log"; grep "adan_step.default(" "$OUT/output-code.log" | tail -2
    ;;
esac
