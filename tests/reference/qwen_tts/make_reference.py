"""Run qwen-tts 0.1.1 on tiny checkpoints and write its outputs as test fixtures.

Runs in the reference venv (setup_reference.sh), not in ours: regenerate.sh calls it as

    python make_reference.py CHECKPOINTS_DIR OUT_DIR

CHECKPOINTS_DIR holds one tiny checkpoint per entry of cases.CHECKPOINTS (CustomVoice/,
VoiceDesign/, Base/, CustomVoice_0.6B/, Base_0.6B/; regenerate.sh builds them). For each case of cases.py
it writes the greedy codes of every group (the talker's `talker_codes_list`) and the waveform
qwen-tts returns; fixture.json records the sha256 of every checkpoint file and of cases.py so
that tests can tell when the fixtures are stale.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cases import CASES, CHECKPOINTS, MAX_NEW_TOKENS, REF_SAMPLE_RATE, reference_audio  # noqa: E402

GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=MAX_NEW_TOKENS)


def file_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def check_fully_loaded(module: torch.nn.Module, weights_file: Path) -> None:
    """Every checkpoint tensor landed in the module unchanged and no parameter was left out:
    a naming slip in the tiny builder must fail here, not pass silently (transformers only warns)."""
    stored = load_file(str(weights_file))
    state = module.state_dict()
    missing, unexpected = sorted(set(state) - set(stored)), sorted(set(stored) - set(state))
    if missing or unexpected:
        raise SystemExit(f"{weights_file}: missing {missing[:10]}, unexpected {unexpected[:10]}")
    changed = [k for k in stored if not torch.equal(state[k].float(), stored[k].float())]
    if changed:
        raise SystemExit(f"{weights_file}: tensors not loaded as stored: {changed[:10]}")


def run_case(model, task_type: str, case: dict) -> tuple[list, np.ndarray]:
    """(codes [frames][groups], waveform) of one case, exactly as qwen-tts computes them."""
    inner = model.model
    captured = {}
    original = inner.generate

    def generate_and_keep_codes(*args, **kwargs):
        codes, hiddens = original(*args, **kwargs)
        captured["codes"] = codes
        return codes, hiddens

    inner.generate = generate_and_keep_codes
    try:
        extra = {k: case[k] for k in ("non_streaming_mode",) if k in case}
        if task_type == "CustomVoice":
            wavs, sr = model.generate_custom_voice(case["text"], speaker=case["speaker"], language=case["language"],
                                                   instruct=case.get("instruct"), **extra, **GREEDY)
        elif task_type == "VoiceDesign":
            wavs, sr = model.generate_voice_design(case["text"], instruct=case["instruct"],
                                                   language=case["language"], **extra, **GREEDY)
        else:
            audio = (np.asarray(reference_audio(), dtype=np.float32), REF_SAMPLE_RATE)
            wavs, sr = model.generate_voice_clone(case["text"], language=case["language"], ref_audio=audio,
                                                  ref_text=case.get("ref_text"),
                                                  x_vector_only_mode=case.get("x_vector_only_mode", False),
                                                  **extra, **GREEDY)
    finally:
        inner.generate = original
    assert sr == 24000, sr
    return captured["codes"][0].tolist(), wavs[0].astype(np.float32)


def reference_extras(model) -> dict[str, list]:
    """Base: the voice-clone prompt (speech tokenizer codes and speaker embedding) of the
    reference audio, so the encoders can be checked on their own."""
    audio = (np.asarray(reference_audio(), dtype=np.float32), REF_SAMPLE_RATE)
    item = model.create_voice_clone_prompt(ref_audio=audio, ref_text="x")[0]
    return {"ref_code": item.ref_code.tolist(), "ref_spk_embedding": item.ref_spk_embedding.float().tolist()}


def main(checkpoints: Path, out_dir: Path) -> None:
    from qwen_tts import Qwen3TTSModel

    torch.manual_seed(0)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, cases in CASES.items():
        task_type = CHECKPOINTS[name]["task_type"]
        ckpt = checkpoints / name
        model = Qwen3TTSModel.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager")
        check_fully_loaded(model.model, ckpt / "model.safetensors")
        check_fully_loaded(model.model.speech_tokenizer.model, ckpt / "speech_tokenizer" / "model.safetensors")
        record = {"qwen_tts": "0.1.1", "checkpoint_sha256": file_hashes(ckpt),
                  "cases_sha256": hashlib.sha256((HERE / "cases.py").read_bytes()).hexdigest(), "cases": {}}
        waves = {}
        for case in cases:
            codes, wav = run_case(model, task_type, case)
            record["cases"][case["name"]] = {"codes": codes, "num_samples": int(wav.shape[0])}
            waves[case["name"]] = wav
            print(f"{name}/{case['name']}: {len(codes)} frames, {wav.shape[0]} samples", flush=True)
        if task_type == "Base":
            record["voice_clone_prompt"] = reference_extras(model)
        (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1))
        np.savez_compressed(out_dir / f"{name}_waveforms.npz", **waves)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
