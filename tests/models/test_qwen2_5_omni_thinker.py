"""Qwen2.5-Omni thinker stage against transformers on a tiny random checkpoint (float32, CPU).

Greedy tokens through our engine (text, audio, image, video, video with its audio track;
chunked prefill, preemption, bfloat16), the hidden states the talker consumes, TMRoPE
positions, M-RoPE cos/sin, and strict loading that skips the other stages' tensors.
Prompts are expanded by hand the way Qwen2_5OmniProcessor does (no torchvision here).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoConfig, Qwen2VLImageProcessorPil, WhisperFeatureExtractor  # noqa: E402
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (  # noqa: E402
    Qwen2_5OmniThinkerForConditionalGeneration as HFThinker,
)

from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.model_executor.layers.rotary import get_rope  # noqa: E402
from vllm_omni.model_executor.model_loader import iterate_safetensors, load_model  # noqa: E402
from vllm_omni.model_executor.models.qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration  # noqa: E402
from vllm_omni.model_executor.models.qwen2_5_omni.positions import MRopeTokenConfig, omni_rope_index  # noqa: E402
from vllm_omni.model_executor.models.registry import resolve_model_class  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt(tiny_model):
    return str(tiny_model("qwen2_5_omni"))  # thinker + talker + token2wav


@pytest.fixture(scope="module")
def hf(ckpt):
    return HFThinker.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(ckpt):
    return LLMEngine(EngineConfig(model=ckpt, model_stage="thinker", device="cpu", dtype="float32",
                                  hidden_state_layers=(0,)))


# --- inputs: placeholder expansion as Qwen2_5OmniProcessor does it -------------------------
def _audio(seconds: float, seed: int) -> dict:
    wav = np.random.RandomState(seed).randn(int(16000 * seconds)).astype(np.float32) * 0.1
    out = WhisperFeatureExtractor(feature_size=128)(
        wav, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
    return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}


def _image() -> dict:
    img = Image.fromarray((np.random.RandomState(0).rand(112, 140, 3) * 255).astype(np.uint8))
    return dict(Qwen2VLImageProcessorPil()(images=[img], return_tensors="pt"))


def _video(grid_t: int) -> dict:
    grid = torch.tensor([[grid_t, 4, 6]])
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(3))
    return {"pixel_values_videos": pixels, "video_grid_thw": grid, "video_second_per_grid": torch.tensor([1.0])}


def _num_audio_tokens(inputs: dict) -> int:
    frames = int(inputs["feature_attention_mask"].sum())
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def make_prompt(tok, kind: str) -> tuple[list[int], dict]:
    t = tok.convert_tokens_to_ids
    text = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    inputs: dict = {}
    media: list[int] = []
    if kind in ("audio", "audio_lengths", "image_audio"):
        inputs |= _audio(2.5, seed=1)
        media += [t("<|audio_bos|>")] + [t("<|AUDIO|>")] * _num_audio_tokens(inputs) + [t("<|audio_eos|>")]
    if kind == "audio_lengths":  # valid frame counts instead of the mask
        inputs["audio_feature_lengths"] = inputs.pop("feature_attention_mask").sum(-1)
    if kind in ("image", "image_audio"):
        inputs |= _image()
        n = int(inputs["image_grid_thw"].prod()) // 4
        media = [t("<|vision_bos|>")] + [t("<|IMAGE|>")] * n + [t("<|vision_eos|>")] + text(" and ") + media
    if kind == "video":
        inputs |= _video(grid_t=2)
        media += [t("<|vision_bos|>")] + [t("<|VIDEO|>")] * (int(inputs["video_grid_thw"].prod()) // 4)
        media += [t("<|vision_eos|>")]
    if kind == "video_audio":  # 4 frames x 1 s = 100 positions: two 2-second chunks of video and audio
        inputs |= _video(grid_t=4) | _audio(2.5, seed=2)
        per_frame, audio_n = 6, _num_audio_tokens(inputs)
        media += [t("<|vision_bos|>"), t("<|audio_bos|>")]
        media += [t("<|VIDEO|>")] * (2 * per_frame) + [t("<|AUDIO|>")] * 50
        media += [t("<|VIDEO|>")] * (2 * per_frame) + [t("<|AUDIO|>")] * (audio_n - 50)
        media += [t("<|audio_eos|>"), t("<|vision_eos|>")]
        inputs["use_audio_in_video"] = True
    prompt = [t("<|im_start|>")] + text("user\n") + media + text("What is this?") + [t("<|im_end|>")]
    prompt += text("\n") + [t("<|im_start|>")] + text("assistant\n")
    return prompt, inputs


def hf_kwargs(inputs: dict) -> dict:
    kw = {k: v for k, v in inputs.items() if k not in ("use_audio_in_video", "audio_feature_lengths")}
    if "audio_feature_lengths" in inputs:  # transformers' thinker needs the mask
        frames = torch.arange(inputs["input_features"].shape[-1])
        kw["feature_attention_mask"] = (frames[None, :] < inputs["audio_feature_lengths"][:, None]).long()
    kw["use_audio_in_video"] = bool(inputs.get("use_audio_in_video", False))
    return kw


def hf_generate(hf, prompt, inputs) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **hf_kwargs(inputs))
    return out[0, len(prompt):].tolist()


def run_engine(engine, prompt, inputs, rid, hidden=False):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert engine.add_request(rid, prompt, params, model_inputs=inputs, return_hidden_states=hidden) is None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                final = out
    return final


KINDS = ["text", "audio", "audio_lengths", "image", "video", "video_audio", "image_audio"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(engine, hf, kind):
    prompt, inputs = make_prompt(engine.tokenizer, kind)
    expected = hf_generate(hf, prompt, inputs)
    assert len(expected) == NEW_TOKENS and len(set(expected)) > 2  # a decisive comparison
    out = run_engine(engine, prompt, inputs, f"greedy-{kind}")
    assert out.new_token_ids == expected


ENGINE_VARIANTS = {
    # Spans start mid-prompt, inside the media, and requests share steps.
    "chunked_prefill": dict(max_num_batched_tokens=7, block_size=8),
    # 16 blocks of 8 cannot hold all three: the youngest is recomputed (encoders run again).
    "preemption": dict(num_kv_blocks=16, max_model_len=128, block_size=8),
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_engine_variants(ckpt, hf, variant):
    engine = LLMEngine(EngineConfig(model=ckpt, model_stage="thinker", device="cpu", dtype="float32",
                                    **ENGINE_VARIANTS[variant]))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # Arrival order: the youngest running request, a media one, is the one preempted.
    cases = {kind: make_prompt(engine.tokenizer, kind) for kind in ("text", "image_audio", "video_audio")}
    for kind, (prompt, inputs) in cases.items():
        engine.add_request(kind, prompt, params, model_inputs=inputs)
    preempted, schedule = [], engine.scheduler.schedule

    def spy():
        out = schedule()
        preempted.extend(r.request_id for r in out.preempted)
        return out

    engine.scheduler.schedule = spy
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert bool(preempted) == (variant == "preemption")
    assert set(preempted) <= {"image_audio", "video_audio"}
    for kind, (prompt, inputs) in cases.items():
        assert outs[kind].new_token_ids == hf_generate(hf, prompt, inputs), kind


def test_hidden_states_for_talker(engine, hf):
    prompt, inputs = make_prompt(engine.tokenizer, "image_audio")
    out = run_engine(engine, prompt, inputs, "hidden", hidden=True)
    states = out.multimodal_output
    # The last sampled token is never fed back, as in transformers' generate.
    seq = prompt + out.new_token_ids[:-1]
    ids = torch.tensor([seq])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, **hf_kwargs(inputs))
    assert set(states) == {"0", "last"}
    assert states["0"].shape == (len(seq), 64)
    torch.testing.assert_close(states["0"], ref.hidden_states[0][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(states["last"], ref.hidden_states[-1][0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["text", "audio", "image_audio", "video", "video_audio"])
def test_positions_match_get_rope_index(engine, hf, kind):
    prompt, inputs = make_prompt(engine.tokenizer, kind)
    lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    ids = torch.tensor([prompt])
    ref, ref_delta = hf.get_rope_index(ids, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                                       torch.ones_like(ids), bool(inputs.get("use_audio_in_video")), lengths,
                                       inputs.get("video_second_per_grid"))
    ours, delta = omni_rope_index(prompt, MRopeTokenConfig.from_config(hf.config), image_grid_thw=inputs.get(
        "image_grid_thw"), video_grid_thw=inputs.get("video_grid_thw"), audio_seqlens=lengths,
        second_per_grids=inputs.get("video_second_per_grid"), use_audio_in_video=bool(inputs.get("use_audio_in_video")))
    assert torch.equal(ours, ref[:, 0]) and delta == int(ref_delta)


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_cos_sin_match_transformers(interleaved):
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniTextConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniRotaryEmbedding
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20] if interleaved else [16, 24, 24]}
    rope |= {"interleaved": True} if interleaved else {}
    cfg_cls, hf_cls = ((Qwen3OmniMoeTextConfig, Qwen3OmniMoeThinkerTextRotaryEmbedding) if interleaved
                       else (Qwen2_5OmniTextConfig, Qwen2_5OmniRotaryEmbedding))
    config = cfg_cls(hidden_size=512, num_attention_heads=4, head_dim=128, rope_parameters=rope,
                     max_position_embeddings=4096)
    ours = get_rope(128, config.rope_parameters, 4096)
    positions = torch.randint(0, 4096, (3, 40), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = hf_cls(config)(torch.zeros(1, dtype=dtype), positions[:, None, :])
        assert all(torch.equal(a, b[0]) for a, b in zip(ours.cos_sin(positions, dtype), (cos, sin)))
    # [T] positions are text positions: plain RoPE.
    flat = positions[0]
    assert torch.equal(ours.cos_sin(flat, torch.float32)[0], ours.cos_sin(flat.expand(3, -1), torch.float32)[0])


def test_registry_and_strict_loading(ckpt):
    for arch in ("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration"):
        assert resolve_model_class(arch, "thinker") is Qwen2_5OmniThinkerForConditionalGeneration
    config = AutoConfig.from_pretrained(ckpt)
    model = load_model(ckpt, config, "float32", "cpu", model_stage="thinker")
    text_config = config.thinker_config.text_config
    assert (model.num_layers, model.hidden_size, model.vocab_size) == (2, 64, text_config.vocab_size)
    assert model.max_position_embeddings == text_config.max_position_embeddings
    weights = list(iterate_safetensors(ckpt))
    assert {n.split(".")[0] for n, _ in weights} == {"thinker", "talker", "token2wav"}
    # Other stages' tensors are skipped; every thinker tensor must land somewhere.
    loaded = model.load_weights(weights + [("talker.model.norm.weight", torch.zeros(3)),
                                           ("token2wav.x.weight", torch.zeros(1))])
    assert "audio_tower.proj.weight" in loaded and "visual.merger.mlp.0.weight" in loaded
    with pytest.raises(ValueError, match="no destination"):
        model.load_weights(weights + [("thinker.visual.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="not loaded"):
        model.load_weights([(n, t) for n, t in weights if n != "thinker.audio_tower.conv1.weight"])


@pytest.mark.parametrize("fresh", [False, True], ids=["resaved", "fresh"])
def test_thinker_only_checkpoint(hf, ckpt, tmp_path, fresh):
    """A checkpoint of the thinker alone loads into the same weights. Its names carry the
    `thinker.` prefix or not (transformers 5.23 keeps it when re-saving a thinker loaded from a
    full checkpoint, 5.17 does not); both load, and the prefix is not required."""
    model = hf
    if fresh:
        model = HFThinker(hf.config)
        model.load_state_dict(hf.state_dict())
    model.save_pretrained(tmp_path)
    if fresh:
        assert not any(n.startswith("thinker.") for n, _ in iterate_safetensors(tmp_path))
    alone = load_model(tmp_path, AutoConfig.from_pretrained(tmp_path), "float32", "cpu")
    assert type(alone) is Qwen2_5OmniThinkerForConditionalGeneration and not alone.whole_omni_checkpoint
    full = load_model(ckpt, AutoConfig.from_pretrained(ckpt), "float32", "cpu", model_stage="thinker")
    theirs = dict(full.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in alone.named_parameters())


def test_bfloat16_media_prompt(ckpt, hf):
    engine = LLMEngine(EngineConfig(model=ckpt, model_stage="thinker", device="cpu", dtype="bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    prompt, inputs = make_prompt(engine.tokenizer, "image_audio")
    out = run_engine(engine, prompt, inputs, "bf16")
    ref = HFThinker.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    assert out.new_token_ids == hf_generate(ref, prompt, inputs)
