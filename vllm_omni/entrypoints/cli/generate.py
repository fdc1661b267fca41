"""`vllm-omni generate`: offline generation through `Omni`, on the embedded demo model by default.

Without MODEL it runs the tiny random-weight Qwen2.5-Omni (thinker -> talker -> code2wav, three
stage processes): it prints each reply's text and writes its speech to a wav file. Any model
works the same way (a plain LM runs as a one-stage pipeline and prints text only).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = ["Hello, who are you?", "What is the capital of France?"]
DEFAULT_SAMPLE_RATE = 24000  # Qwen2.5-Omni / Qwen3-Omni speech, when an output does not say


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text (and speech) offline; no MODEL: the embedded tiny Qwen2.5-Omni demo (random weights)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (Hugging Face layout)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="send each prompt as a user chat message (default: yes for multi-stage models, "
                        "no for plain LMs, whose prompts are tokenized as is)")
    p.add_argument("--image", action="append", default=[], help="image file/URL added to every prompt")
    p.add_argument("--audio", action="append", default=[], help="audio file/URL added to every prompt")
    p.add_argument("--video", action="append", default=[], help="video file/URL added to every prompt")
    p.add_argument("--use-audio-in-video", action="store_true", help="also listen to the videos' sound")
    p.add_argument("--speaker", default=None, help="voice of the spoken reply (e.g. Chelsie, Ethan)")
    p.add_argument("--modalities", default=None, help="comma-separated outputs, e.g. text or text,audio")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="text tokens per reply; TTS: codec frames (default: the stage config's)")
    p.add_argument("--temperature", type=float, default=None, help="default 0 (greedy); TTS: the model's")
    # Text to speech (Qwen3-TTS, docs/tts.md): each --prompt is the text to speak.
    p.add_argument("--instructions", default=None, help="TTS: speaking style, or the voice (VoiceDesign)")
    p.add_argument("--language", default=None, help="TTS: language of the text (default Auto)")
    p.add_argument("--task-type", default=None, choices=["CustomVoice", "VoiceDesign", "Base"],
                   help="TTS: checked against the checkpoint's type")
    p.add_argument("--ref-audio", default=None, help="TTS voice cloning (Base): reference audio file/URL")
    p.add_argument("--ref-text", default=None, help="TTS voice cloning: transcript of --ref-audio")
    p.add_argument("--top-p", type=float, default=None, help="default 1.0; TTS: the model's")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--stage-configs-path", default=None, help="a legacy stage_args YAML")
    p.add_argument("--deploy-config", default=None, help="a deploy YAML")
    p.add_argument("--stage-overrides", default=None, help="per-stage JSON overrides")
    p.add_argument("--output-dir", default="vllm_omni_output", help="where audio replies are written")
    # Diffusion models (images out): `vllm-omni generate MODEL --prompt ... -o out.png`.
    p.add_argument("-o", "--output", default=None,
                   help="image (or video: .mp4) file to write (more: NAME_1.png, ...)")
    p.add_argument("--negative-prompt", default=None, help="what the image should not show (enables CFG)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num-inference-steps", type=int, default=None)
    p.add_argument("--true-cfg-scale", type=float, default=None)
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--num-images-per-prompt", type=int, default=None)
    # Video models (Wan2.2): `-o out.mp4`; --image is the first frame (image to video).
    p.add_argument("--num-frames", type=int, default=None, help="video frames (Wan: 4k + 1; default: the model's)")
    p.add_argument("--guidance-scale-2", type=float, default=None, help="the low-noise expert's guidance (Wan2.2 A14B)")
    p.add_argument("--fps", type=float, default=None, help="the MP4's frame rate (default: the model's)")


def build_prompts(args: argparse.Namespace, chat: bool) -> list[Any]:
    texts = args.prompt or DEFAULT_PROMPTS
    media = ([{"type": "image", "image": m} for m in args.image] + [{"type": "audio", "audio": m} for m in args.audio]
             + [{"type": "video", "video": m} for m in args.video])
    if media and not chat:
        raise SystemExit("--image/--audio/--video need --chat (a multimodal model)")
    prompts = []
    for text in texts:
        prompt: dict[str, Any] = (
            {"messages": [{"role": "user", "content": [*media, {"type": "text", "text": text}]}]} if chat
            else {"prompt": text})
        if args.speaker is not None:
            prompt["speaker"] = args.speaker
        if args.use_audio_in_video:
            prompt["mm_processor_kwargs"] = {"use_audio_in_video": True}
        prompt.update({key: value for key, value in _tts_options(args).items() if value is not None})
        prompts.append(prompt)
    return prompts


def _tts_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"instructions": args.instructions, "language": args.language, "task_type": args.task_type,
            "ref_audio": args.ref_audio, "ref_text": args.ref_text}


def _speaks_from_text(model: str) -> bool:
    from vllm_omni.model_executor.models.families import local_family

    family = local_family(model)
    return family is not None and family.speaks_from_text


def run(args: argparse.Namespace) -> int:
    from vllm_omni.entrypoints.omni import Omni
    from vllm_omni.sampling_params import SamplingParams
    from vllm_omni.config import ConfigFormat, WorkerType
    from vllm_omni.testing import demo_model_path

    from vllm_omni.engine.stage_init_utils import prepare_engine_environment

    prepare_engine_environment()  # before anything (building the demo) picks a start method
    model = args.model or str(demo_model_path())
    modalities = args.modalities.split(",") if args.modalities else None
    engine_args = {"dtype": args.dtype} if args.dtype else {}
    with Omni(model, stage_configs_path=args.stage_configs_path, deploy_config=args.deploy_config,
              stage_overrides=args.stage_overrides, output_modalities=modalities, **engine_args) as omni:
        if omni.pipeline.entry_stages[0].worker_type == WorkerType.DIFFUSION:
            from vllm_omni.entrypoints.cli.generate_images import generate_images

            return generate_images(omni, args)
        # A plain LM runs as a one-stage pipeline; anything bundled (Omni models) is chat-first.
        # A TTS model speaks the prompt itself and keeps its own sampling defaults.
        tts = _speaks_from_text(model)
        chat = args.chat if args.chat is not None else omni.pipeline.format is not ConfigFormat.SINGLE_STAGE and not tts
        prompts = build_prompts(args, chat)
        overrides = {key: value for key, value in (("temperature", args.temperature), ("top_p", args.top_p),
                                                    ("seed", args.seed), ("max_tokens", args.max_tokens))
                     if value is not None}
        if not tts:  # greedy text unless asked otherwise
            overrides = {"temperature": 0.0, "top_p": 1.0, **overrides}
        stage0 = omni.pipeline.stages[0].new_sampling_params(**overrides)
        params: list[SamplingParams | None] = [stage0] + [None] * (len(omni.pipeline.stages) - 1)
        outputs = omni.generate(prompts, params, use_tqdm=False, modalities=modalities)
    if args.model is None:
        print(f"(embedded demo model at {model}: random weights, so the text is random words and the speech noise)")
    texts = args.prompt or DEFAULT_PROMPTS
    order = list(dict.fromkeys(o.request_id for o in outputs))
    for out in outputs:
        index = order.index(out.request_id)
        comp = out.request_output.outputs[0]
        if out.error is not None:
            print(f"[{index}] error: {out.error}")
        elif out.final_output_type == "audio":
            print(f"[{index}] audio: {_write_audio(comp.multimodal_output, Path(args.output_dir), index)}")
        else:
            print(f"[{index}] prompt: {texts[index]!r}\n[{index}] {out.final_output_type}: {comp.text!r}  "
                  f"[{comp.finish_reason}]")
    return 1 if any(o.error is not None for o in outputs) else 0


def _write_audio(tensors: dict, out_dir: Path, index: int) -> str:
    import soundfile as sf

    wav = tensors["audio"].float().reshape(-1).numpy()
    rate = int(tensors["sample_rate"]) if "sample_rate" in tensors else DEFAULT_SAMPLE_RATE
    out_dir.mkdir(parents=True, exist_ok=True)
    path = (out_dir / f"reply_{index}.wav").resolve()
    sf.write(str(path), wav.clip(-1.0, 1.0), rate, subtype="PCM_16")
    return f"{path} ({len(wav) / rate:.2f} s at {rate} Hz)"
