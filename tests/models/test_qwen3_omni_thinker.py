"""Qwen3-Omni thinker stage against transformers on a tiny random checkpoint (float32, CPU).

Greedy tokens through our engine (text, audio, image, video, video with its audio track, a
video at a fractional frame time; chunked prefill), the hidden states the talker consumes
("0" and the accept layer, around DeepStack), M-RoPE positions against `get_rope_index`,
the float-position rotary, and strict loading that skips the other stages' tensors.
Prompts are expanded by hand the way Qwen3OmniMoeProcessor does (no torchvision here).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoConfig, Qwen2VLImageProcessorPil, WhisperFeatureExtractor  # noqa: E402
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (  # noqa: E402
    Qwen3OmniMoeThinkerForConditionalGeneration as HFThinker,
)

from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.model_executor.model_loader import iterate_safetensors, load_model  # noqa: E402
from vllm_omni.model_executor.models.qwen3_omni import Qwen3OmniMoeThinkerForConditionalGeneration  # noqa: E402
from vllm_omni.model_executor.models.qwen3_omni.deepstack import InterleavedMRotaryEmbedding  # noqa: E402
from vllm_omni.model_executor.models.qwen3_omni.rope_index import (  # noqa: E402
    RopeTokenConfig,
    audio_output_length,
    qwen3_omni_rope_index,
)
from vllm_omni.model_executor.models.registry import resolve_model_class  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402

NEW_TOKENS = 12
ACCEPT_LAYER = 1  # the tiny talker's accept_hidden_layer


@pytest.fixture(scope="module")
def ckpt(tiny_model):
    return str(tiny_model("qwen3_omni_moe"))  # thinker + talker + code2wav


@pytest.fixture(scope="module")
def hf(ckpt):
    return HFThinker.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(ckpt):
    layers = Qwen3OmniMoeThinkerForConditionalGeneration.exported_hidden_states(AutoConfig.from_pretrained(ckpt))
    assert layers == (0, ACCEPT_LAYER)
    return LLMEngine(EngineConfig(model=ckpt, model_stage="thinker", device="cpu", dtype="float32",
                                  hidden_state_layers=layers))


# --- inputs: placeholder expansion as Qwen3OmniMoeProcessor does it ------------------------
def _audio(seconds: float, seed: int) -> dict:
    wav = np.random.RandomState(seed).randn(int(16000 * seconds)).astype(np.float32) * 0.1
    out = WhisperFeatureExtractor(feature_size=128)(
        wav, sampling_rate=16000, return_attention_mask=True, padding=True, return_tensors="pt")
    return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}


def _image(seed: int = 0) -> dict:
    img = Image.fromarray((np.random.RandomState(seed).rand(96, 128, 3) * 255).astype(np.uint8))
    processor = Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return dict(processor(images=[img], return_tensors="pt"))


def _video(grid_t: int, second_per_grid: float) -> dict:
    grid = torch.tensor([[grid_t, 4, 6]])
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(3))
    return {"pixel_values_videos": pixels, "video_grid_thw": grid,
            "video_second_per_grid": torch.tensor([second_per_grid])}


def _num_audio_tokens(inputs: dict) -> int:
    return audio_output_length(int(inputs["feature_attention_mask"].sum()))


def _video_with_audio(t, inputs: dict, pps: int) -> list[int]:
    """The processor's `replace_video_with_audio_token`: video and audio tokens merged by time."""
    grid = inputs["video_grid_thw"][0].tolist()
    per_frame = grid[1] // 2 * grid[2] // 2
    video_t = (torch.arange(grid[0]) * inputs["video_second_per_grid"][0] * pps).repeat_interleave(per_frame).tolist()
    audio_t = list(range(_num_audio_tokens(inputs)))
    out, vi, ai = [], 0, 0
    while vi < len(video_t) and ai < len(audio_t):
        if video_t[vi] <= audio_t[ai]:
            out, vi = out + [t("<|video_pad|>")], vi + 1
        else:
            out, ai = out + [t("<|audio_pad|>")], ai + 1
    out += [t("<|video_pad|>")] * (len(video_t) - vi) + [t("<|audio_pad|>")] * (len(audio_t) - ai)
    return [t("<|audio_start|>")] + out + [t("<|audio_end|>")]


def make_prompt(tok, kind: str, pps: int = 13) -> tuple[list[int], dict]:
    t = tok.convert_tokens_to_ids
    text = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    inputs: dict = {}
    media: list[int] = []
    if kind in ("audio", "image_audio"):
        inputs |= _audio(2.5, seed=1)
        media += [t("<|audio_start|>")] + [t("<|audio_pad|>")] * _num_audio_tokens(inputs) + [t("<|audio_end|>")]
    if kind in ("image", "image_audio", "two_images"):
        inputs |= _image()
        n = int(inputs["image_grid_thw"].prod()) // 4
        media = [t("<|vision_start|>")] + [t("<|image_pad|>")] * n + [t("<|vision_end|>")] + text(" and ") + media
    if kind == "two_images":  # a second, differently sized image
        second = Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)(
            images=[Image.fromarray((np.random.RandomState(5).rand(64, 96, 3) * 255).astype(np.uint8))],
            return_tensors="pt")
        inputs["pixel_values"] = torch.cat([inputs["pixel_values"], second["pixel_values"]])
        inputs["image_grid_thw"] = torch.cat([inputs["image_grid_thw"], second["image_grid_thw"]])
        n = int(second["image_grid_thw"].prod()) // 4
        media += [t("<|vision_start|>")] + [t("<|image_pad|>")] * n + [t("<|vision_end|>")]
    if kind in ("video", "video_frac"):  # 0.7 s per grid: frame times 9.1, 18.2, ... (fractional)
        inputs |= _video(grid_t=2 if kind == "video" else 3, second_per_grid=1.0 if kind == "video" else 0.7)
        n = int(inputs["video_grid_thw"].prod()) // 4
        media += [t("<|vision_start|>")] + [t("<|video_pad|>")] * n + [t("<|vision_end|>")]
    if kind == "video_audio":  # 4 frames at t = 0, 13, 26, 39; 33 audio tokens end before the last frame
        inputs |= _video(grid_t=4, second_per_grid=1.0) | _audio(2.5, seed=2)
        media += [t("<|vision_start|>")] + _video_with_audio(t, inputs, pps) + [t("<|vision_end|>")]
        inputs["use_audio_in_video"] = True
    prompt = [t("<|im_start|>")] + text("user\n") + media + text("What is this?") + [t("<|im_end|>")]
    prompt += text("\n") + [t("<|im_start|>")] + text("assistant\n")
    return prompt, inputs


def hf_kwargs(inputs: dict) -> dict:
    return {**{k: v for k, v in inputs.items() if k != "use_audio_in_video"},
            "use_audio_in_video": bool(inputs.get("use_audio_in_video", False))}


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


# Plain integral-time video and several images are covered by video_audio and the positions test.
KINDS = ["text", "audio", "image", "image_audio", "video_frac", "video_audio"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(engine, hf, kind):
    prompt, inputs = make_prompt(engine.tokenizer, kind)
    expected = hf_generate(hf, prompt, inputs)
    assert len(expected) == NEW_TOKENS and len(set(expected)) > 2  # a decisive comparison
    out = run_engine(engine, prompt, inputs, f"greedy-{kind}")
    assert out.new_token_ids == expected


ENGINE_VARIANTS = {
    # 7-token steps: spans start mid-prompt and inside the media, and requests share steps, so
    # one step's DeepStack rows come from several requests' spans.
    "chunked_prefill": dict(max_num_batched_tokens=7, block_size=8),
    # 12 blocks of 8: text + image_audio (prompts of 12 and 63 tokens) fit, then outgrow the pool
    # while decoding: the youngest media request is recomputed (encoders run again).
    "preemption": dict(num_kv_blocks=12, max_model_len=96, block_size=8),
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


@pytest.mark.parametrize("kind", ["image_audio", "video_audio"])
def test_hidden_states_for_talker(engine, hf, kind):
    prompt, inputs = make_prompt(engine.tokenizer, kind)
    out = run_engine(engine, prompt, inputs, f"hidden-{kind}", hidden=True)
    states = out.multimodal_output
    # The last sampled token is never fed back, as in transformers' generate.
    seq = prompt + out.new_token_ids[:-1]
    ids = torch.tensor([seq])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, **hf_kwargs(inputs))
    assert set(states) == {"0", str(ACCEPT_LAYER), "last"}
    assert states["0"].shape == (len(seq), 64)
    # Layer outputs reach ~100 in this random model: 1e-4 absolute plus 1e-5 of the value
    # (attention kernels differ in summation order); DeepStack placement errors are O(1).
    for key, index in (("0", 0), (str(ACCEPT_LAYER), ACCEPT_LAYER), ("last", -1)):
        torch.testing.assert_close(states[key], ref.hidden_states[index][0], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["text", "audio", "image_audio", "two_images", "video", "video_frac", "video_audio"])
def test_positions_match_get_rope_index(engine, hf, kind):
    prompt, inputs = make_prompt(engine.tokenizer, kind)
    lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    ids = torch.tensor([prompt])
    ref, ref_delta = hf.model.get_rope_index(ids, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                                             torch.ones_like(ids), bool(inputs.get("use_audio_in_video")), lengths,
                                             inputs.get("video_second_per_grid"))
    ours, delta = qwen3_omni_rope_index(
        prompt, RopeTokenConfig.from_config(hf.config), image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"), audio_seqlens=lengths,
        second_per_grids=inputs.get("video_second_per_grid"), use_audio_in_video=bool(inputs.get("use_audio_in_video")))
    assert ours.dtype == torch.float32 and torch.equal(ours, ref[:, 0].float()) and delta == float(ref_delta)
    if kind == "video_frac":
        assert not torch.equal(ours, ours.round())


def test_rotary_float_positions_match_transformers():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20]}  # no layout flag: HF interleaves
    config = Qwen3OmniMoeTextConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_parameters=rope,
                                    max_position_embeddings=4096)
    ours = InterleavedMRotaryEmbedding(128, config.rope_parameters, 4096)
    ints = torch.randint(0, 4096, (3, 40), generator=torch.Generator().manual_seed(0))
    fractional = ints.float() + 0.3
    hf_rope = Qwen3OmniMoeThinkerTextRotaryEmbedding(config)
    for positions in (ints, fractional):
        cos, sin = hf_rope(torch.zeros(1), positions[:, None, :])
        ours_cos, ours_sin = ours.cos_sin(positions, torch.float32)
        torch.testing.assert_close(ours_cos, cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(ours_sin, sin[0], atol=1e-6, rtol=0)
    assert torch.equal(ours.cos_sin(ints, torch.float32)[0], hf_rope(torch.zeros(1), ints[:, None, :])[0][0])


def test_registry_and_strict_loading(ckpt):
    assert resolve_model_class("Qwen3OmniMoeForConditionalGeneration", "thinker") is \
        Qwen3OmniMoeThinkerForConditionalGeneration
    assert resolve_model_class("Qwen3OmniMoeThinkerForConditionalGeneration") is \
        Qwen3OmniMoeThinkerForConditionalGeneration
    assert Qwen3OmniMoeThinkerForConditionalGeneration.supports_cuda_graphs  # where MoE layers capture
    config = AutoConfig.from_pretrained(ckpt)
    model = load_model(ckpt, config, "float32", "cpu", model_stage="thinker")
    assert model.exported_hidden_states(config) == (0, ACCEPT_LAYER)
    assert (model.num_layers, model.hidden_size) == (2, 64)
    weights = list(iterate_safetensors(ckpt))
    assert {n.split(".")[0] for n, _ in weights} == {"thinker", "talker", "code2wav"}
    # Per-expert checkpoint tensors land in the fused experts.
    expert = dict(weights)["thinker.model.layers.1.mlp.experts.3.up_proj.weight"]
    assert torch.equal(model.model.layers[1].mlp.experts.w13_weight[3, 32:], expert)
    loaded = model.load_weights(weights)
    assert "audio_tower.proj2.weight" in loaded and "visual.merger_list.0.mlp.0.weight" in loaded
    with pytest.raises(ValueError, match="no destination"):
        model.load_weights(weights + [("thinker.visual.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="not loaded"):
        model.load_weights([(n, t) for n, t in weights if n != "thinker.visual.merger_list.0.ln_q.weight"])


@pytest.mark.parametrize("fresh", [False, True], ids=["resaved", "fresh"])
def test_thinker_only_checkpoint(hf, ckpt, tmp_path, fresh):
    """A checkpoint of the thinker alone (names with `thinker.` when re-saved from the full
    checkpoint, without when saved fresh) loads into the same weights and exports layer 0 only."""
    model = hf
    if fresh:
        model = HFThinker(hf.config)
        model.load_state_dict(hf.state_dict())
    model.save_pretrained(tmp_path)
    alone_config = AutoConfig.from_pretrained(tmp_path)
    alone = load_model(tmp_path, alone_config, "float32", "cpu")
    assert type(alone) is Qwen3OmniMoeThinkerForConditionalGeneration and not alone.whole_omni_checkpoint
    assert alone.exported_hidden_states(alone_config) == (0,)
    full = load_model(ckpt, AutoConfig.from_pretrained(ckpt), "float32", "cpu", model_stage="thinker")
    theirs = dict(full.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in alone.named_parameters())


def test_a_graph_replayed_step_leaves_no_deepstack_spans():
    """A decode step replayed from a CUDA graph embeds its requests but never runs forward: the
    next step starts clean (begin_step), so a prefill's DeepStack rows land on its own tokens."""
    from vllm_omni.model_executor.models.qwen3_omni.deepstack import StepDeepstack

    model = Qwen3OmniMoeThinkerForConditionalGeneration.__new__(Qwen3OmniMoeThinkerForConditionalGeneration)
    object.__setattr__(model, "step_deepstack", StepDeepstack())  # only what begin_step touches
    model.step_deepstack.add(1)  # the replayed decode step's span
    model.begin_step()
    embeds = torch.randn(2, 1, 4)
    model.step_deepstack.add(2)  # a text request, then one with a visual token at row 0
    model.step_deepstack.add(3, torch.tensor([0]), embeds[:, :1])
    taken = model.step_deepstack.take(5)
    assert taken.rows.tolist() == [2] and torch.equal(taken.embeds, embeds[:, :1])


def test_only_text_and_audio_prompts_replay_prefill_graphs():
    """DeepStack adds visual features inside the forward: image and video prompts prefill eagerly."""
    from types import SimpleNamespace

    from vllm_omni.model_executor.models.omni_thinker import ThinkerMediaInputs

    def graphable(**media) -> bool:
        inputs = ThinkerMediaInputs(**media) if media else None
        return Qwen3OmniMoeThinkerForConditionalGeneration.prefill_graphable(None, SimpleNamespace(model_inputs=inputs))

    assert graphable() and graphable(input_features=torch.zeros(1, 128, 10))
    assert not graphable(pixel_values=torch.zeros(4, 8), image_grid_thw=torch.tensor([[1, 2, 2]]))
    assert not graphable(pixel_values_videos=torch.zeros(4, 8), video_grid_thw=torch.tensor([[1, 2, 2]]))
