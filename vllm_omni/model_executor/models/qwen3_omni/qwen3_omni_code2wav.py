"""Qwen3-Omni code2wav stage: RVQ codec frames -> 24 kHz waveform, as a generation-stage model.

A thin wrapper around transformers' `Qwen3OmniMoeCode2Wav` (loaded from the checkpoint's
`code2wav.*` tensors) driven as `stage_io.GenerationModel`. It decodes like transformers'
`Qwen3OmniMoeForConditionalGeneration.generate`: `chunked_decode` with chunks of 300 frames
and 25 frames of left context.

Input: a request's prompt_token_ids are its codes flattened codebook-major (the
talker2code2wav bridge): num_quantizers runs of `frames` codes. Requests of any lengths share
one batch: the decoder is causal (causal convolutions, causal sliding-window attention), so
frames past a request's end (padding) cannot change its samples; each waveform is then cut
at its own length, the way transformers batches its talker outputs.
"""
from __future__ import annotations

import torch

from vllm_omni.model_executor.dtypes import canonical_dtype, torch_dtype
from vllm_omni.stage_io import StageRequest
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav import _prefixed_tensors

SAMPLE_RATE = 24000
WEIGHT_PREFIX = "code2wav."
CHUNK_FRAMES = 300  # transformers' generate: chunked_decode(chunk_size=300, left_context_size=25)
LEFT_CONTEXT_FRAMES = 25


class Qwen3OmniMoeCode2Wav:
    """GenerationModel for the `code2wav` stage; `generate_batch` -> [{"audio": float32 [N],
    "sample_rate": int32 []}]."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self.num_quantizers = module.config.num_quantizers
        self.codebook_size = module.config.codebook_size
        self.samples_per_frame = int(module.total_upsample)
        self.sample_rate = SAMPLE_RATE

    @classmethod
    def load(cls, model_path: str, *, model_stage: str | None = None, device: torch.device | str = "cpu",
             dtype: str = "auto", load_format: str = "auto") -> Qwen3OmniMoeCode2Wav:
        from transformers import AutoConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav as HFCode2Wav

        # "auto" is float32, not the checkpoint's bf16: the vocoder is small and its output is
        # audio samples, where half precision is audible; ask for bfloat16 explicitly to save time.
        param_dtype = torch.float32 if canonical_dtype(dtype) == "auto" else torch_dtype(dtype)
        config = AutoConfig.from_pretrained(model_path)
        c2w_config = getattr(config, "code2wav_config", None)
        if c2w_config is None:
            raise ValueError(f"{model_path}: config has no code2wav_config (not a Qwen3-Omni checkpoint?)")
        device = torch.device(device)
        with torch.device(device):  # random init (overwritten below) is much faster on a GPU
            module = HFCode2Wav(c2w_config)
        module = module.to(param_dtype)
        if load_format != "dummy":  # dummy: keep the random init (benchmarks)
            module.load_state_dict(_prefixed_tensors(model_path, WEIGHT_PREFIX), strict=True)
        return cls(module.eval(), device)

    @torch.inference_mode()
    def generate_batch(self, inputs: list[StageRequest]) -> list[dict[str, torch.Tensor]]:
        codes = [self._codes(req) for req in inputs]
        lengths = [c.shape[1] for c in codes]
        wavs = [torch.zeros(0, dtype=torch.float32) for _ in inputs]
        live = [i for i, n in enumerate(lengths) if n > 0]
        if live:
            longest = max(lengths[i] for i in live)
            batch = torch.zeros(len(live), self.num_quantizers, longest, dtype=torch.long)
            for row, i in enumerate(live):
                batch[row, :, : lengths[i]] = codes[i]
            out = self.module.chunked_decode(batch.to(self.device), chunk_size=CHUNK_FRAMES,
                                             left_context_size=LEFT_CONTEXT_FRAMES)  # [B, 1, samples]
            # Each chunk drops the same number of trailing samples (causal transposed convs).
            lost = (longest * self.samples_per_frame - out.shape[-1]) // _num_chunks(longest)
            out = out[:, 0].float().cpu()
            for row, i in enumerate(live):
                wavs[i] = out[row, : lengths[i] * self.samples_per_frame - lost * _num_chunks(lengths[i])].clone()
        # The rate travels with the audio, as Qwen2.5-Omni's does, so callers (CLI, server) can
        # encode it without knowing the model; a 0-dim tensor is metadata, never concatenated.
        rate = torch.tensor(self.sample_rate, dtype=torch.int32)
        return [{"audio": wav, "sample_rate": rate} for wav in wavs]

    def _codes(self, req: StageRequest) -> torch.Tensor:
        """[num_quantizers, frames] from the codebook-major flat prompt."""
        flat = torch.tensor(req.prompt_token_ids, dtype=torch.long)
        if flat.numel() % self.num_quantizers:
            raise ValueError(f"request {req.request_id}: {flat.numel()} codes are not a whole number of frames of "
                             f"{self.num_quantizers} codebooks")
        if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < self.codebook_size):
            raise ValueError(f"request {req.request_id}: codec codes must lie in [0, {self.codebook_size})")
        return flat.view(self.num_quantizers, -1)


def _num_chunks(frames: int) -> int:
    return -(-frames // CHUNK_FRAMES)
