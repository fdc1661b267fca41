#!/usr/bin/env bash
# The GPU round of issue 14 on one H200, in parts that each fit one device call (<= 10 min):
#   benchmarks/h200_round.sh tests     # GPU tests: fast paths against eager / torch paths
#   benchmarks/h200_round.sh qwen2_5   # Qwen2.5-Omni-7B end to end, streaming and not, vs transformers
#   benchmarks/h200_round.sh qwen2_5_stream  # its streaming path alone, with the code2wav GPU tests
#   benchmarks/h200_round.sh qwen3     # Qwen3-Omni-30B-A3B end to end, c = 1..64, vs transformers
#   benchmarks/h200_round.sh tts       # Qwen3-TTS 1.7B: c = 1, 16, 64 and Poisson arrivals
#   benchmarks/h200_round.sh tts_sharing  # talker and code2wav processes time-sliced or under MPS
#   benchmarks/h200_round.sh tts_load  # the TTS talker's steps at 64 in flight under cProfile, streaming or not
#   benchmarks/h200_round.sh qwen3_timeline  # Qwen3-Omni at one request: every stage's step timeline
#   benchmarks/h200_round.sh qwen3_load  # Qwen3-Omni at 1, 8, 32 in flight (32 requests each), timelines
#   benchmarks/h200_round.sh qwen2_5_timeline  # Qwen2.5-Omni-7B at one request, streaming: every stage's timeline
#   benchmarks/h200_round.sh token2wav_first  # Qwen2.5-Omni token2wav alone at batch 1: its first window
#   benchmarks/h200_round.sh tts_clone  # Qwen3-TTS voice cloning (Base): first step, first audio at 1 and 16 in flight
#   benchmarks/h200_round.sh tts_reference  # a new cloned voice: its encoders eager vs in graphs, alone and end to end
#   benchmarks/h200_round.sh tts_lanes  # its code2wav's steady-chunk graphs and first-chunk lane, A/B/C
#   benchmarks/h200_round.sh tts_poisson_timeline  # Qwen3-TTS under Poisson arrivals: both stages' step timelines
#   benchmarks/h200_round.sh code2wav_precision  # Qwen3 / TTS code2wav: TF32 and bfloat16 tolerances and speed
#   benchmarks/h200_round.sh vocoder   # codec vocoders: fused layers or torch's (kernel tables), their GPU tests
#   benchmarks/h200_round.sh vocoder_tts  # Qwen3-TTS end to end, vocoder layers fused or not (RUNS, MODES), short requests
#   benchmarks/h200_round.sh tts_code2wav  # the TTS code2wav stage's steps at 64 in flight under the torch profiler
#   benchmarks/h200_round.sh tts_batches  # the TTS talker's decode step at batch 1..64 (profiled)
#   benchmarks/h200_round.sh tts_ab    # its code2wav decoder graphs vs the eager decoder, two runs each
#   benchmarks/h200_round.sh first_frame  # its talker's first step, prefill graphs vs eager, with a profile
#   benchmarks/h200_round.sh profile   # the Qwen2.5-Omni talker's step under the torch profiler
#   benchmarks/h200_round.sh moe       # a MoE layer at decode: few-token and expert-sorted kernels vs grouped GEMMs
#   benchmarks/h200_round.sh pdl       # each talker alone, programmatic dependent launch on and off
#   benchmarks/h200_round.sh talker    # each talker alone (Qwen3's with its code predictor): ms/step
#   benchmarks/h200_round.sh async     # each talker alone with async scheduling on and off (A/B in one call)
#   benchmarks/h200_round.sh norm_linear  # RMSNorm fused into the next product vs apart, program shapes
#   benchmarks/h200_round.sh stages    # code2wav / token2wav, Qwen3-TTS, Qwen-Image on their own
#   benchmarks/h200_round.sh diffusion # Qwen-Image 1024^2, 50 steps vs diffusers; one step per attention/compile setting
#   benchmarks/h200_round.sh diffusion_accel  # Qwen-Image 1024^2: FP8, TeaCache, cache-dit, fixed schedule (s + PSNR)
#   benchmarks/h200_round.sh video     # Wan2.2: compiled stage vs diffusers (GPU tests), T2V-A14B step + video
#   benchmarks/h200_round.sh video_ti2v  # Wan2.2 TI2V-5B 1280x704x121: one step and a 4-step video vs diffusers
#   benchmarks/h200_round.sh i44       # issue 44 in one call (~9.5 min): the TTS Poisson sweep (1/10/20/40 req/s,
#                                      # 30 s each), HTTP vs AsyncOmni, Qwen3-Omni c=1/64, Qwen2.5-Omni c=1/32
#   benchmarks/h200_round.sh i44_tts   # its TTS half (the sweep, HTTP vs AsyncOmni, 20 req/s with admission)
#   benchmarks/h200_round.sh i44_omni  # its Omni half, and the GPU tests of issue 44
#   benchmarks/h200_round.sh i44_omni_http  # Qwen3-Omni c=1 in-process and through vllm-omni serve
#   benchmarks/h200_round.sh tts_ramp  # Qwen3-TTS at 20 req/s, chunk ramp divisor 1 and 2 alternately
#   benchmarks/h200_round.sh tts_hold  # Qwen3-TTS at RATE req/s (10), code2wav's first-chunk hold rule A/B, in turn
#   benchmarks/h200_round.sh tts_sweep_http  # Qwen3-TTS at 10 then 20 req/s, then Qwen3-Omni c=1 through HTTP
#   BEFORE=dir benchmarks/h200_round.sh i43_ab  # the Omni end-to-end runs on an earlier tree (BEFORE, e.g.
#                                      # git archive of the commit before issue 43) and on this one, alternately
#                                      # (ORDER="before after after before" repeats them in both orders)
#   BEFORE=dir benchmarks/h200_round.sh i43_46  # that pair "before after", then sleep_memory.py and
#                                      # bench_weight_load.py on the Qwen2.5-Omni-7B architecture
#   benchmarks/h200_round.sh i47_46    # stored voice vs preset first audio, the speech socket; sleep mode
# Logs and JSON go to $OUT (or ./h200_out). Each step has its own time limit, so one slow step
# still leaves the others' results.
set -u
export PYTHONUNBUFFERED=1  # a step cut by its time limit still leaves its log
OUT=${OUT:-h200_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: some steps run in another folder
PY=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - t0))s"
  grep -E "^\|| log_stats|stage [0-9].*ms|^batch [0-9]+:|^first step|Error|error:|^\[|^c=|^poisson|^HTTP vs|first audio ms|took .* ms|Triton kernel|^max_frames_per_token|underruns by chunk|pipeline up in|server up in| \+[0-9]+s: " \
    "$OUT/$name.log" | tail -40
}
# Issue 44's runs (docs/benchmarks.md, "Sustained load"): every run sustained (closed loops of >= 4 x C
# requests, >= 30 s of Poisson arrivals), the first 10% warm-up; kernel compiles while serving logged.
i44_tts() {
  step i44_tts_sweep 330 env VLLM_OMNI_LOG_COMPILES=1 $PY benchmarks/bench_tts.py --real-arch --frames 38-100 \
    --concurrency "" --rate 1,10,20,40 --json "$OUT/i44_tts_sweep.json"
  step i44_tts_http 100 $PY benchmarks/bench_tts.py --real-arch --frames 38-100 --concurrency 1 --num-requests 20 \
    --mode both --json "$OUT/i44_tts_http.json"
}
i44_omni() {
  step i44_qwen3 135 env VLLM_OMNI_LOG_COMPILES=1 $PY benchmarks/bench_omni_e2e.py \
    --dummy-config benchmarks/configs/qwen3_omni_30b_a3b.json --concurrency 1,64 --prompt-words 74 \
    --text-tokens 64 --codec-tokens 100 --skip-hf --async-chunk on --json "$OUT/i44_qwen3.json"
  step i44_qwen2_5 115 env VLLM_OMNI_LOG_COMPILES=1 $PY benchmarks/bench_omni_e2e.py \
    --dummy-config benchmarks/configs/qwen2_5_omni_7b.json --concurrency 1,32 --prompt-words 100 \
    --text-tokens 128 --codec-tokens 500 --skip-hf --async-chunk on --json "$OUT/i44_qwen2_5.json"
}
i44_omni_http() {  # issue 44 item 3 for the omni models: the same c=1 run in-process, then through vllm-omni serve
  step i44_qwen3_http 200 $PY benchmarks/bench_omni_e2e.py --dummy-config benchmarks/configs/qwen3_omni_30b_a3b.json \
    --concurrency 1 --prompt-words 74 --text-tokens 64 --codec-tokens 100 --skip-hf --async-chunk on --mode both \
    --json "$OUT/i44_qwen3_http.json"
}
# Issue 43 changed no computation: the same end-to-end runs on an earlier tree ($BEFORE) and on this one,
# alternately (ORDER, default "after before"), each in its own process with the same benchmark script.
i43_ab() {
  local before
  before=$(cd "${BEFORE:?BEFORE=a tree of the earlier commit}" && pwd)
  local q3="--dummy-config benchmarks/configs/qwen3_omni_30b_a3b.json --concurrency 1,64 --prompt-words 74
    --text-tokens 64 --codec-tokens 100 --skip-hf --async-chunk on"
  local q25="--dummy-config benchmarks/configs/qwen2_5_omni_7b.json --concurrency 1,8 --prompt-words 100
    --text-tokens 128 --codec-tokens 500 --skip-hf --async-chunk on"
  local model args n tree dir
  for model in qwen3 qwen2_5; do
    args=$([ $model = qwen3 ] && echo "$q3" || echo "$q25")
    n=0
    for tree in ${ORDER:-after before}; do
      n=$((n + 1))
      dir=$([ $tree = before ] && echo "$before" || pwd)
      step i43_${model}_${n}_$tree 130 env -C "$dir" PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" \
        $PY benchmarks/bench_omni_e2e.py $args --json "$OUT/i43_${model}_${n}_$tree.json"
    done
  done
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:-}" in
  tests)
    step gpu_tests 420 $PY -m pytest -q tests/gpu -p no:cacheprovider ;;
  qwen2_5)
    step e2e_qwen2_5 560 $PY benchmarks/bench_omni_e2e.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json \
      --concurrency 1,8,32 --num-requests 8 --prompt-words 100 --text-tokens 128 --codec-tokens 500 \
      --hf-requests 1 --async-chunk both --json "$OUT/e2e_qwen2_5.json" ;;
  qwen2_5_stream)  # the streaming path alone (after a change to it), with its GPU tests
    step code2wav_tests 150 $PY -m pytest -q tests/gpu/test_code2wav_precision.py -p no:cacheprovider
    step e2e_qwen2_5_stream 420 $PY benchmarks/bench_omni_e2e.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json \
      --concurrency 1,8,32 --num-requests 8 --prompt-words 100 --text-tokens 128 --codec-tokens 500 \
      --skip-hf --async-chunk on --json "$OUT/e2e_qwen2_5_stream.json" ;;
  tts)  # Qwen3-TTS alone (its start-up does not fit the stages part's limit)
    step tts 480 $PY benchmarks/bench_tts.py --real-arch --concurrency 1,16,64 --num-requests 32 --frames 120 \
      --rate 20 --json "$OUT/tts.json" ;;
  tts_ab)  # the code2wav decoder graphs against the eager decoder, alternating, in one call
    for run in 1 2; do
      for mode in eager graphs; do
        flag=$([ $mode = eager ] && echo --code2wav-eager)
        step tts_${mode}_$run 140 $PY benchmarks/bench_tts.py --real-arch --concurrency 1,64 --num-requests 32 \
          --frames 120 --rate 20 $flag --json "$OUT/tts_${mode}_$run.json"
      done
    done ;;
  tts_sharing)  # how the talker and code2wav processes share the GPU: time slicing (the default) or MPS
    args="--real-arch --concurrency 1,64 --num-requests 32 --frames 120 --rate 20"
    step tts_processes 150 $PY benchmarks/bench_tts.py $args --json "$OUT/tts_processes.json"
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    if nvidia-cuda-mps-control -d; then
      step tts_mps 150 $PY benchmarks/bench_tts.py $args --json "$OUT/tts_mps.json"
      echo quit | nvidia-cuda-mps-control
    fi ;;
  tts_load)  # the talker's steps at 64 in flight under cProfile, code2wav streaming (sharing the GPU) or not
    sed 's/^async_chunk: true/async_chunk: false/' vllm_omni/deploy/qwen3_tts.yaml > "$OUT/qwen3_tts_whole.yaml"
    for mode in streaming whole; do
      deploy=$([ $mode = whole ] && echo "--deploy-config $OUT/qwen3_tts_whole.yaml")
      step tts_load_$mode 150 env VLLM_OMNI_PROFILE_DIR="$OUT/tts_load_$mode" VLLM_OMNI_PROFILE_STAGES=0 \
        VLLM_OMNI_PROFILE_SKIP=300 VLLM_OMNI_PROFILE_STEPS=40 VLLM_OMNI_PROFILE_OPS=0 VLLM_OMNI_PROFILE_PYTHON=1 \
        $PY benchmarks/bench_tts.py --real-arch --concurrency 64 --num-requests 64 --frames 120 $deploy
      grep -h "wall per step" "$OUT"/tts_load_$mode/stage*-profile.txt
    done ;;
  qwen3_timeline)  # Qwen3-Omni at one request: every stage's step timeline (one clock), where first audio goes
    step qwen3_timeline 300 env VLLM_OMNI_PROFILE_DIR="$OUT/qwen3_timeline" VLLM_OMNI_PROFILE_STAGES=0,1,2 \
      VLLM_OMNI_PROFILE_SKIP=0 VLLM_OMNI_PROFILE_STEPS=100000 VLLM_OMNI_PROFILE_OPS=0 \
      $PY benchmarks/bench_omni_e2e.py --dummy-config benchmarks/configs/qwen3_omni_30b_a3b.json --concurrency 1 \
      --num-requests 4 --prompt-words 74 --text-tokens 64 --codec-tokens 100 --skip-hf --async-chunk on \
      --stage-overrides '{"0":{"max_num_seqs":8},"1":{"max_num_seqs":8},"2":{"max_num_seqs":8}}' \
      --log-requests --json "$OUT/qwen3_timeline.json" ;;
  qwen3_load)  # issue 11's load levels; the timelines (one tar, few files) say where first audio goes
    step qwen3_load 420 env VLLM_OMNI_PROFILE_DIR="$OUT/qwen3_load" VLLM_OMNI_PROFILE_STAGES=0,1,2 \
      VLLM_OMNI_PROFILE_SKIP=0 VLLM_OMNI_PROFILE_STEPS=1000000 VLLM_OMNI_PROFILE_OPS=0 \
      $PY benchmarks/bench_omni_e2e.py --dummy-config benchmarks/configs/qwen3_omni_30b_a3b.json --concurrency 1,8,32 \
      --num-requests 32 --prompt-words 74 --text-tokens 64 --codec-tokens 100 --skip-hf --async-chunk on \
      --log-requests --json "$OUT/qwen3_load.json"
    tar -C "$OUT" -czf "$OUT/qwen3_load.tgz" qwen3_load && rm -r "$OUT/qwen3_load" ;;
  qwen2_5_timeline)
    step qwen2_5_timeline 300 env VLLM_OMNI_PROFILE_DIR="$OUT/qwen2_5_timeline" VLLM_OMNI_PROFILE_STAGES=0,1,2 \
      VLLM_OMNI_PROFILE_SKIP=0 VLLM_OMNI_PROFILE_STEPS=100000 VLLM_OMNI_PROFILE_OPS=0 \
      $PY benchmarks/bench_omni_e2e.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json --concurrency 1 \
      --num-requests 2 --prompt-words 100 --text-tokens 128 --codec-tokens 500 --skip-hf --async-chunk on \
      --log-requests --json "$OUT/qwen2_5_timeline.json" ;;
  token2wav_first)  # the Qwen2.5-Omni token2wav stage alone: its first streamed window at batch 1
    step token2wav_first 150 $PY benchmarks/bench_code2wav.py --families qwen2_5 --precision tf32,bfloat16 --batches 1 \
      --skip-hf --json "$OUT/token2wav_first.json" ;;
  tts_clone)  # one voice cloned by every request (encoded once), then every request a new voice
    for voices in 1 0; do
      step tts_clone_v$voices 150 $PY benchmarks/bench_tts_first_frame.py --real-arch --task Base --voices $voices \
        --requests 10 --json "$OUT/tts_clone_first_v$voices.json"
      step tts_clone_e2e_v$voices 200 $PY benchmarks/bench_tts.py --real-arch --task Base --voices $voices \
        --concurrency 1,16 --num-requests 16 --frames 120 --json "$OUT/tts_clone_v$voices.json"
    done ;;
  tts_reference)
    step tts_reference 100 $PY benchmarks/bench_tts_reference.py --real-arch --seconds 2,5,10 --reps 10 \
      --json "$OUT/tts_reference.json"
    for g in 1 0; do
      step tts_clone_new_g$g 200 env VLLM_OMNI_REFERENCE_CUDA_GRAPHS=$g $PY benchmarks/bench_tts.py --real-arch \
        --task Base --voices 0 --concurrency 1,16 --num-requests 16 --frames 120 --json "$OUT/tts_clone_new_g$g.json"
    done ;;
  tts_lanes)  # code2wav: steady-chunk graphs and the first-chunk lane, each off and on (RUNS, MODES: which)
    step decode_lane_tests 200 $PY -m pytest -q tests/gpu/test_decode_lanes.py tests/gpu/test_decoder_graphs.py \
      -p no:cacheprovider
    for run in ${RUNS:-1}; do
      for mode in ${MODES:-before steady lanes}; do
        step tts_${mode}_$run 150 env VLLM_OMNI_STEADY_CHUNK_GRAPHS=$([ $mode = before ] && echo 0 || echo 1) \
          VLLM_OMNI_DECODE_LANES=$([ $mode = lanes ] && echo 1 || echo 0) $PY benchmarks/bench_tts.py --real-arch \
          --concurrency 1,64 --num-requests 32 --frames 120 --rate 20 --json "$OUT/tts_${mode}_$run.json"
      done
    done ;;
  tts_poisson_timeline)  # each request's submission and first audio (JSON each[]) on the timelines' clock
    # FRAMES=38-100 NUM=64: the short requests of round 10's unexplained tail. Limits fit a cold
    # machine (its first bench_tts start-up, Triton kernels compiled, takes ~2 min).
    tag=${FRAMES:-120}
    step tts_poisson_timeline_$tag 300 env VLLM_OMNI_PROFILE_DIR="$OUT/tts_poisson_$tag" VLLM_OMNI_PROFILE_STAGES=0,1 \
      VLLM_OMNI_PROFILE_SKIP=0 VLLM_OMNI_PROFILE_STEPS=1000000 VLLM_OMNI_PROFILE_OPS=0 \
      $PY benchmarks/bench_tts.py --real-arch --concurrency "" --num-requests ${NUM:-32} --frames ${FRAMES:-120} --rate 20 \
      --json "$OUT/tts_poisson_$tag.json"
    tar -C "$OUT" -czf "$OUT/tts_poisson_$tag.tgz" tts_poisson_$tag && rm -r "$OUT/tts_poisson_$tag" ;;
  code2wav_precision)  # Qwen3 / TTS code2wav: waveform tolerances of TF32 and bfloat16, then their speed
    step code2wav_tests 200 $PY -m pytest -q tests/gpu/test_code2wav_precision.py tests/gpu/test_decoder_graphs.py \
      -k "not qwen2_5 and not dit" -s -p no:cacheprovider
    step code2wav_qwen3 150 $PY benchmarks/bench_code2wav.py --families qwen3 --precision float32,tf32,bfloat16 \
      --skip-hf --json "$OUT/code2wav_qwen3.json" ;;
  vocoder)  # codec vocoders, fused layers (layers/vocoder.py) or torch's: each stage alone, where its GPU time goes
    step vocoder_tests 240 $PY -m pytest -q tests/gpu/test_cuda_ops.py tests/gpu/test_code2wav_precision.py \
      tests/gpu/test_decoder_graphs.py tests/gpu/test_decode_lanes.py -k "snake or fused or streams or chunks" \
      -p no:cacheprovider
    tail -3 "$OUT/vocoder_tests.log"
    for fused in 0 1; do
      step code2wav_tts_fused$fused 120 env VLLM_OMNI_FUSED_VOCODER=$fused $PY benchmarks/bench_code2wav.py \
        --families qwen3_tts --precision tf32 --skip-hf --profile 25 --json /tmp/code2wav_tts.json
      grep -A 24 "32 streams: top" "$OUT/code2wav_tts_fused$fused.log" | cut -c1-100,175-200
      step code2wav_qwen3_fused$fused 120 env VLLM_OMNI_FUSED_VOCODER=$fused $PY benchmarks/bench_code2wav.py \
        --families qwen3 --precision tf32 --batches 8,32 --skip-hf --json /tmp/code2wav_qwen3.json
    done ;;
  vocoder_tts)  # bench_tts with the vocoder layers fused or not (9.6 s requests), then fused on 3-8 s requests
    for run in ${RUNS:-1}; do
      for fused in ${MODES:-0 1}; do
        step tts_fused${fused}_$run 240 env VLLM_OMNI_FUSED_VOCODER=$fused $PY benchmarks/bench_tts.py --real-arch \
          --concurrency 1,64 --num-requests 32 --frames 120 --rate 20 --json "/tmp/tts_fused${fused}_$run.json"
      done
    done
    step tts_short 240 $PY benchmarks/bench_tts.py --real-arch --concurrency 1,64 --num-requests 64 --frames 38-100 \
      --rate 20 --json /tmp/tts_short.json ;;
  tts_code2wav)  # skip the warm-up and the ramp: 40 steps of steady decoding under the torch profiler
    step tts_code2wav 200 env VLLM_OMNI_PROFILE_DIR="$OUT/tts_code2wav" VLLM_OMNI_PROFILE_STAGES=0,1 \
      VLLM_OMNI_PROFILE_SKIP=300 VLLM_OMNI_PROFILE_STEPS=40 \
      $PY benchmarks/bench_tts.py --real-arch --concurrency 64 --num-requests 64 --frames 120
    grep -h "wall per step" "$OUT"/tts_code2wav/stage*-profile.txt ;;
  tts_batches)  # the TTS talker's steady decode step at batch 1..64, the largest under the profiler
    step tts_batches 100 $PY benchmarks/bench_tts_first_frame.py --real-arch --batches 1,8,32,64 --decode-steps 30 \
      --json "$OUT/tts_batches.json"
    # as requests of bench_tts.py sample: seeded (spec 000's default seed 42) with min_tokens
    step tts_batches_seeded 150 $PY benchmarks/bench_tts_first_frame.py --real-arch --batches 1,8,32,64 \
      --decode-steps 30 --seed 42 --min-tokens 100000 --profile "$OUT/tts_batches" --json "$OUT/tts_batches_seeded.json" ;;
  first_frame)  # the TTS talker's first step (the prefill and the first frame): prefill graphs vs eager
    step first_frame 150 $PY benchmarks/bench_tts_first_frame.py --real-arch --requests 20 --profile "$OUT/first_frame"
    step first_frame_eager 150 env VLLM_OMNI_PREFILL_CUDA_GRAPHS=0 $PY benchmarks/bench_tts_first_frame.py \
      --real-arch --requests 20 ;;
  profile)  # where the Qwen2.5-Omni talker's step goes (engine/step_profiler.py), 1 and 8 in flight
    for c in 1 8; do  # skip the warm-up request's 500 talker steps, then 200 steps of the measured ones
      step profile_c$c 200 env VLLM_OMNI_PROFILE_DIR="$OUT/profile_c$c" VLLM_OMNI_PROFILE_STAGES=1 \
        VLLM_OMNI_PROFILE_SKIP=600 VLLM_OMNI_PROFILE_STEPS=200 $PY benchmarks/bench_omni_e2e.py \
        --dummy-config benchmarks/configs/qwen2_5_omni_7b.json --concurrency $c --num-requests $c \
        --prompt-words 100 --text-tokens 128 --codec-tokens 500 --skip-hf --async-chunk off
    done ;;
  async)  # async scheduling on and off, each talker alone, alternately in one call
    for a in 1 0; do
      step talker_async$a 150 env VLLM_OMNI_ASYNC_SCHEDULING=$a $PY benchmarks/bench_talker_step.py \
        --dummy-config benchmarks/configs/qwen2_5_omni_7b.json --batches 1,8,32 --json "$OUT/talker_async$a.json"
      step talker_qwen3_async$a 150 env VLLM_OMNI_ASYNC_SCHEDULING=$a $PY benchmarks/bench_talker_step.py \
        --dummy-config benchmarks/configs/qwen3_omni_30b_a3b.json --batches 1,32 --steps 40 \
        --json "$OUT/talker_qwen3_async$a.json"
    done ;;
  norm_linear)  # RMSNorm fused into the next product (cuda_ops.norm_linear) vs apart, with its GPU tests
    step norm_linear_tests 150 $PY -m pytest -q tests/gpu/test_cuda_ops.py -k "norm_linear or decoder_layers" -p no:cacheprovider
    step norm_linear 200 $PY benchmarks/bench_norm_linear.py --sweep ;;
  moe)  # a MoE layer at decode: the few-token and expert-sorted kernels (moe_ops) vs the grouped GEMMs, with their GPU tests
    step moe_tests 150 $PY -m pytest -q tests/gpu/test_moe_ops.py -p no:cacheprovider
    step moe_decode 150 $PY benchmarks/bench_moe_decode.py ;;
  pdl)  # each talker alone with programmatic dependent launch on and off (A/B in one call)
    for pdl in 1 0; do
      VLLM_OMNI_PDL=$pdl step talker_pdl$pdl 150 $PY benchmarks/bench_talker_step.py \
        --dummy-config benchmarks/configs/qwen2_5_omni_7b.json --batches 1,32 --steps 60 --json "$OUT/talker_pdl$pdl.json"
      VLLM_OMNI_PDL=$pdl step talker_qwen3_pdl$pdl 150 $PY benchmarks/bench_talker_step.py \
        --dummy-config benchmarks/configs/qwen3_omni_30b_a3b.json --batches 1,32 --steps 60 \
        --json "$OUT/talker_qwen3_pdl$pdl.json"
    done ;;
  talker)  # each talker stage alone (bench_talker_step.py); Qwen2.5's with a torch profiler table per batch
    step talker_step 300 $PY benchmarks/bench_talker_step.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json \
      --batches 1,8,32 --json "$OUT/talker_step.json"
    step talker_step_qwen3 300 $PY benchmarks/bench_talker_step.py \
      --dummy-config benchmarks/configs/qwen3_omni_30b_a3b.json --batches 1,8,32,64 --json "$OUT/talker_step_qwen3.json"
    step talker_profile 200 $PY benchmarks/bench_talker_step.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json \
      --batches 1,8 --steps 50 --profile "$OUT/talker_profile" --json "$OUT/talker_profile.json" ;;
  qwen3)
    step e2e_qwen3 560 $PY benchmarks/bench_omni_e2e.py --dummy-config benchmarks/configs/qwen3_omni_30b_a3b.json \
      --concurrency 1,8,32,64 --num-requests 8 --prompt-words 74 --text-tokens 64 --codec-tokens 100 \
      --hf-requests 1 --async-chunk on --json "$OUT/e2e_qwen3.json" ;;
  stages)
    step code2wav_qwen3 120 $PY benchmarks/bench_code2wav.py --families qwen3 --precision float32,bfloat16 \
      --json "$OUT/code2wav_qwen3.json"
    step token2wav_qwen2_5 120 $PY benchmarks/bench_code2wav.py --families qwen2_5 --precision float32,bfloat16 \
      --batches 1,8 --json "$OUT/token2wav_qwen2_5.json"
    step token2wav_compiled 100 $PY benchmarks/bench_code2wav.py --families qwen2_5 --precision bfloat16 \
      --batches 1,8 --compile-mode reduce-overhead --skip-hf --json "$OUT/token2wav_compiled.json"
    step tts 100 $PY benchmarks/bench_tts.py --real-arch --concurrency 1,16,64 --num-requests 64 --frames 120 \
      --json "$OUT/tts.json"
    step diffusion 120 $PY benchmarks/bench_diffusion.py --size 512 --steps 20 --batch-sizes 1,4 \
      --json "$OUT/diffusion.json" ;;
  diffusion)
    step diffusion_step 200 $PY benchmarks/bench_diffusion_step.py --profile CUDNN_ATTN+compile \
      --json "$OUT/diffusion_step.json"
    step diffusion_1024 380 $PY benchmarks/bench_diffusion.py --size 1024 --steps 50 --batch-sizes 1,4 \
      --json "$OUT/diffusion_1024.json" ;;
  diffusion_accel)  # one device call: the FP8 GPU tests, then every variant's s/image and PSNR vs bf16
    step fp8_gpu_tests 60 $PY -m pytest -q tests/gpu/test_fp8_scaled_mm.py -p no:cacheprovider
    step diffusion_accel 500 $PY benchmarks/bench_diffusion_accel.py --json "$OUT/diffusion_accel.json" ;;
  video)  # needs diffusers, accelerate, ftfy and av (carried as wheels)
    step wan_gpu_tests 180 $PY -m pytest -q tests/gpu/test_wan_compiled.py -p no:cacheprovider
    step video_a14b 400 $PY benchmarks/bench_video.py --models a14b --json "$OUT/video_a14b.json" ;;
  video_ti2v)
    step video_ti2v 560 $PY benchmarks/bench_video.py --models ti2v --json "$OUT/video_ti2v.json" ;;
  i43_ab) i43_ab ;;
  i43_46)  # issue 43's pair in the other order, then issue 46's figures on the 7B architecture
    ORDER=${ORDER:-before after} i43_ab
    step sleep_memory 150 $PY benchmarks/sleep_memory.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json \
      --json "$OUT/sleep_memory.json"
    step weight_load 200 $PY benchmarks/bench_weight_load.py --device cuda --threads 1 8 --repeats 1 \
      --json "$OUT/weight_load.json" ;;
  i47_46)  # issue 47's first-audio figures, then issue 46's sleep mode on the GPU
    step tts_stored_voice 100 $PY benchmarks/bench_tts.py --real-arch --task Base --stored-voice --concurrency 1 \
      --num-requests 32 --json "$OUT/tts_stored_voice.json"
    step tts_preset 90 $PY benchmarks/bench_tts.py --real-arch --concurrency 1 --num-requests 32 \
      --json "$OUT/tts_preset.json"
    # Text written at twice the speaking pace (still "at least as fast as it is spoken"): ~10 s a session.
    step tts_stream 170 $PY benchmarks/bench_tts_stream.py --real-arch --sessions 3 --chars-per-s 30 \
      --max-frames-per-token 0,4 --json "$OUT/tts_stream.json"
    step sleep_tests 100 $PY -m pytest -q tests/gpu/test_sleep_mode.py tests/gpu/test_memory_sizing.py -s \
      -p no:cacheprovider
    step sleep_memory 150 $PY benchmarks/sleep_memory.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json \
      --json "$OUT/sleep_memory.json" ;;
  i44) i44_tts; i44_omni ;;
  i44_tts)
    i44_tts
    # The rate where the pipeline saturates (round 22: 20 req/s), now with admission by playback load:
    # new requests wait instead (its holds are logged every 5 s).
    step i44_tts_20_queue 240 $PY benchmarks/bench_tts.py --real-arch --frames 38-100 --concurrency "" --rate 20 \
      --admission-policy queue --json "$OUT/i44_tts_20_queue.json" ;;
  tts_ramp)  # Qwen3-TTS at 20 req/s: the doubling chunk ramp against the slower one (divisor 2), alternately
    sed 's/^      codec_left_context_frames: 25$/&\n      codec_chunk_ramp_divisor: 2/' vllm_omni/deploy/qwen3_tts.yaml \
      > "$OUT/qwen3_tts_ramp2.yaml"
    grep -q codec_chunk_ramp_divisor "$OUT/qwen3_tts_ramp2.yaml" || { echo "the deploy edit failed"; exit 1; }
    for ramp in 1 2 1 2; do
      n=$((${n:-0} + 1))
      deploy=$([ $ramp = 2 ] && echo "--deploy-config $OUT/qwen3_tts_ramp2.yaml")
      step tts_ramp_${n}_d$ramp 120 $PY benchmarks/bench_tts.py --real-arch --frames 38-100 --concurrency "" \
        --rate 20 $deploy --json "$OUT/tts_ramp_${n}_d$ramp.json"
    done ;;
  tts_hold)  # Qwen3-TTS at RATE req/s: first chunks held by any playing stream due sooner, or by one close to dry
    # Each run starts its own pipeline (20-40 s on a warm H200): RUNS, one hold rule each, in turn.
    # RATE 10 (default) until the 20 req/s stall of round 23 is understood.
    for hold in ${RUNS:-margin deadline}; do
      n=$((${n:-0} + 1))
      step tts_hold_${n}_$hold 150 env VLLM_OMNI_FIRST_CHUNK_HOLD=$hold $PY benchmarks/bench_tts.py --real-arch \
        --frames 38-100 --concurrency "" --rate ${RATE:-10} --json "$OUT/tts_hold_${n}_$hold.json"
    done ;;
  i44_omni_http) i44_omni_http ;;
  tts_sweep_http)  # the TTS sweep at 10 and 20 req/s in one process (a 20 req/s run alone stalled twice), then
    # issue 44 item 3 for Qwen3-Omni
    step tts_sweep 200 env VLLM_OMNI_LOG_COMPILES=1 $PY benchmarks/bench_tts.py --real-arch --frames 38-100 \
      --concurrency "" --rate 10,20 --json "$OUT/tts_sweep.json"
    i44_omni_http ;;
  i44_omni)
    step i44_gpu_tests 100 $PY -m pytest -q tests/gpu/test_predictor_slices.py tests/gpu/test_kernel_compile_log.py \
      -p no:cacheprovider
    i44_omni ;;
  *) sed -n 's/^#   benchmarks\/h200_round.sh /  /p' "$0"; exit 2 ;;
esac
# The device call brings back at most 8 files: past that, the logs travel as one archive.
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar -czf logs.tgz --remove-files ./*.log)
fi
