"""Sleep mode on a device: the memory the stages give back when they sleep, the time to sleep and to
wake up, and whether the outputs after waking equal those before (greedy, the same prompt).

Runs an omni pipeline through `Omni` (real stage processes) with `enable_sleep_mode`, then for
level 1 and level 2: sleep, read the device's used memory (torch.cuda.mem_get_info in this
process: every process on the device counts), wake up, generate again and compare: the text,
the talker's codes and the audio. A control generates twice before the first sleep: what two
runs of one awake pipeline differ by, without any sleep.

    python benchmarks/sleep_memory.py                      # the demo model (CPU: no memory figures)
    python benchmarks/sleep_memory.py --json sleep.json    # the demo model on the GPU
    # the real architecture, random bf16 weights (AR stages with CUDA graphs):
    python benchmarks/sleep_memory.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json --json sleep.json

With --dummy-config the weights are random: level 2 wakes by drawing them again, which gives the AR
stages the same weights (seeded by name) but token2wav new ones (torch's random init), so its
audio is compared at level 1 only.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint folder (default: the demo model)")
    p.add_argument("--dummy-config", default=None, help="real config.json: random weights of that architecture")
    p.add_argument("--text-tokens", type=int, default=16)
    p.add_argument("--codec-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    return p.parse_args()


def used_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def main() -> None:
    from vllm_omni import Omni

    args = parse_args()
    talker: dict[str, Any] = {"max_tokens": args.codec_tokens, "min_tokens": args.codec_tokens}
    overrides: dict[str, Any] = {"1": {"default_sampling_params": talker}}
    prompt: dict[str, Any] = {"prompt": "Tell me about the river in the morning."}
    if args.dummy_config:
        from vllm_omni.testing.dummy_checkpoints import chat_prompt_ids, make_dummy_omni_checkpoint

        from bench_omni_e2e import codec_code_count

        model = str(make_dummy_omni_checkpoint(args.dummy_config, Path(tempfile.mkdtemp()) / "dummy"))
        # A random talker also samples its special ids, which no vocoder decodes: only real codes.
        talker.update(temperature=0.0, ignore_eos=True,
                      allowed_token_ids=list(range(codec_code_count(json.loads(Path(args.dummy_config).read_text())))))
        for stage in ("0", "1", "2"):
            overrides.setdefault(stage, {})["load_format"] = "dummy"
        for stage in ("0", "1"):  # the AR stages: bf16 and CUDA graphs, as served
            overrides[stage].update(enforce_eager=False, dtype="bfloat16")
        prompt = {"prompt_token_ids": chat_prompt_ids(64)}
    else:
        from vllm_omni.testing import demo_model_path

        model = args.model or str(demo_model_path())
    baseline = used_gib()
    t0 = time.perf_counter()
    omni = Omni(model, enable_sleep_mode=True, stage_overrides=overrides)
    startup = time.perf_counter() - t0
    params = [{"max_tokens": args.text_tokens, "min_tokens": args.text_tokens, "temperature": 0.0}, None, None]

    def answer() -> dict[str, Any]:
        outs = {o.final_output_type: o for o in omni.generate([prompt], params, use_tqdm=False)}
        audio = outs["audio"].request_output.outputs[0].multimodal_output["audio"]
        return {"text_tokens": outs["text"].request_output.outputs[0].token_ids, "audio": audio.float().cpu(),
                # code2wav's input: the talker's codes, as they streamed in
                "codes": list(outs["audio"].request_output.prompt_token_ids)}

    def compare(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        same_length = after["audio"].shape == before["audio"].shape
        return {"same_text": after["text_tokens"] == before["text_tokens"], "same_codes": after["codes"] == before["codes"],
                "same_audio": torch.equal(after["audio"], before["audio"]),
                "audio_max_abs_diff": (after["audio"] - before["audio"]).abs().max().item() if same_length else None}

    rows = []
    try:
        before = answer()
        control = compare(answer(), before)
        awake = used_gib()
        for level in (1, 2):
            t = time.perf_counter()
            omni.sleep(level)
            slept_s, asleep = time.perf_counter() - t, used_gib()
            t = time.perf_counter()
            omni.wake_up()
            woke_s, rewoken = time.perf_counter() - t, used_gib()
            rows.append({"level": level, "sleep_s": slept_s, "wake_up_s": woke_s, "used_gib_asleep": asleep,
                         "used_gib_awake_again": rewoken, **compare(answer(), before)})
    finally:
        omni.close()
    result = {"model": args.dummy_config or model, "device": torch.cuda.get_device_name() if baseline is not None
              else "cpu", "startup_s": startup, "used_gib_before_start": baseline, "used_gib_awake": awake,
              "control": control, "levels": rows}
    print(json.dumps(result, indent=2))

    def same(r: dict[str, Any]) -> str:
        return (f"same text {r['same_text']}, codes {r['same_codes']}, audio {r['same_audio']} "
                f"(max difference {r['audio_max_abs_diff']})")

    print(f"control, awake twice: {same(control)}")
    for r in rows:
        memory = ""
        if baseline is not None:
            held, returned = awake - baseline, awake - r["used_gib_asleep"]
            memory = f"the stages held {held:.2f} GiB, gave back {returned:.2f} GiB ({100 * returned / held:.0f}%); "
        print(f"level {r['level']}: {memory}sleep {r['sleep_s']:.1f} s, wake up {r['wake_up_s']:.1f} s; {same(r)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
