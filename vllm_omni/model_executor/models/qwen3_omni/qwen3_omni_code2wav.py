"""Qwen3-Omni code2wav stage: RVQ codec frames -> 24 kHz waveform, as a generation-stage model.

A wrapper around transformers' `Qwen3OmniMoeCode2Wav` (loaded from the checkpoint's
`code2wav.*` tensors) whose vocoder layers are replaced by ours (layers/vocoder.py: the same
parameters and math, fused on CUDA), driven as a `GenerationModel` (streaming too):

- `generate_batch` decodes whole requests like transformers' `generate`: `chunked_decode`
  with chunks of 300 frames and 25 frames of left context (and, like it, without the few
  samples at the end of each 300-frame chunk that its transposed convolutions cannot finish).
- `open_stream` / `decode_streams` decode a request chunk by chunk as the talker produces it
  (code2wav_stream.py); each chunk re-decodes the unfinished samples of the one before, so
  the joined stream has no gap, and it equals the whole decode but for the context cut.
  Nearly all of the work is the vocoder (the convolutions after the ConvNeXt upsampling), and
  it reads only `vocoder_context_frames` frames back (5 of the released model's 25 frames of
  context): a chunk runs the transformer over its whole window and the vocoder from there on
  (`_decode_from`), like Qwen3-TTS's decoder (qwen3_tts/speech_decoder.py).

Requests of any lengths share a call: the decoder is causal (causal convolutions, causal
sliding-window attention), so frames past a request's end (right padding) cannot change its
samples; each waveform is cut at its own length. Calls group rows of similar length
(`plan_padded_calls`), so a short first chunk is not padded to a long window.
"""
from __future__ import annotations

import math

import torch

from vllm_omni.model_executor.layers.activation import SnakeBeta
from vllm_omni.model_executor.layers.vocoder import CausalConv, CausalTransConv, ResidualUnit, run_layers
from vllm_omni.model_executor.model_loader import prefixed_tensors
from vllm_omni.model_executor.models.codec_streaming import (
    CausalConvLayer, Precision, TransConvLayer, chunk_output, context_frames, own_streams, plan_padded_calls,
    prompt_frames, resolve_precision,
)
from vllm_omni.model_executor.models.decoder_graphs import StreamGraphs, streams_within_budget
from vllm_omni.model_executor.models.generation_model import GenerationModel
from vllm_omni.model_executor.models.code2wav_stream import Code2WavStream, Code2WavStreamConfig
from vllm_omni.stage_io import StageRequest, StreamingDecoder

SAMPLE_RATE = 24000
WEIGHT_PREFIX = "code2wav."
CHUNK_FRAMES = 300  # transformers' generate: chunked_decode(chunk_size=300, left_context_size=25)
LEFT_CONTEXT_FRAMES = 25
# Padding a row by this many frames costs about one extra decode call (upstream vLLM-Omni
# measured 32 frames on the GPU); rows further apart in length get separate calls.
CALL_COST_FRAMES = 32


class Qwen3OmniMoeCode2Wav(GenerationModel):
    """The `code2wav` stage, whole requests or streamed; each result is {"audio": float32 [N],
    "sample_rate": int32 []} (a stream's chunks carry the rate in the first one only)."""

    stream_options_type = Code2WavStreamConfig  # load(stream_config=...) from the input connector's options
    supports_cuda_graphs = True  # load(cuda_graphs=not enforce_eager)
    accepts_streamed_input = True

    def __init__(self, module: torch.nn.Module, device: torch.device, precision: Precision = Precision.FLOAT32,
                 stream_config: Code2WavStreamConfig | None = None, compile_mode: str | None = None,
                 cuda_graphs: bool = False) -> None:
        _own_vocoder_layers(module)
        self.module = module
        self.device = device
        self.precision = precision
        self.stream_config = stream_config or Code2WavStreamConfig()
        self.max_units_per_chunk = max(self.stream_config.initial_chunk_frames, self.stream_config.chunk_frames)
        self.num_quantizers = module.config.num_quantizers
        self.codebook_size = module.config.codebook_size
        self.samples_per_frame = int(module.total_upsample)
        self.sample_rate = SAMPLE_RATE
        # A window of n frames decodes to n * samples_per_frame - unfinished_samples samples.
        self.unfinished_samples = _unfinished_samples(module.config.upsample_rates)
        # The vocoder's input has this many samples per frame (the ConvNeXt upsampling's kernel =
        # stride transposed convolutions trim nothing), and reads this many frames back for a
        # chunk's new samples, which start `unfinished_samples` before the chunk's first frame.
        self.vocoder_input_per_frame = math.prod(module.config.upsampling_ratios)
        self.vocoder_context_frames = context_frames(_vocoder_layers(module.decoder), self.vocoder_input_per_frame,
                                                     output_reach=self.unfinished_samples)
        if self.stream_config.left_context_frames * self.samples_per_frame < self.unfinished_samples:
            raise ValueError(f"code2wav: {self.stream_config.left_context_frames} frames of left context cannot "
                             f"re-decode the {self.unfinished_samples} samples a chunk leaves unfinished")
        # Benchmark option (GPU): torch.compile the decoder ("reduce-overhead" captures CUDA
        # graphs), static shapes: each new (rows, frames) compiles once; eager unless asked for.
        self._forward = module if compile_mode is None else torch.compile(module, mode=compile_mode, dynamic=False)
        # Streams call `_decode_from(codes, skip_frames)`: the vocoder skips the context no row needs.
        self._stream_forward = (self._decode_from if compile_mode is None
                                else torch.compile(self._decode_from, mode=compile_mode, dynamic=False))
        # Streamed windows of a few requests replay CUDA graphs (decoder_graphs.py; the decoder is
        # causal and the padded frames only reach the samples each window cuts anyway), first
        # chunks from graphs of their own (StreamGraphs).
        self.graphs: StreamGraphs | None = None
        # Two calls may overlap (first chunks while later ones run, decode_lanes.py): nothing but
        # the graphs is shared, and first chunks have their own. torch.compile's graphs are not ours.
        self.overlaps_first_chunks = compile_mode is None
        if cuda_graphs and device.type == "cuda" and compile_mode is None:
            self.graphs = StreamGraphs(self._decode_from, self.num_quantizers, self.samples_per_frame,
                                       self.stream_config, self.vocoder_context_frames)
            with precision.scope(device):
                self.graphs.capture_all(device)

    @classmethod
    def load(cls, model_path: str, *, model_stage: str | None = None, device: torch.device | str = "cpu",
             dtype: str = "auto", load_format: str = "auto", precision: str | None = None,
             stream_config: Code2WavStreamConfig | None = None,
             compile_mode: str | None = None, cuda_graphs: bool = False) -> Qwen3OmniMoeCode2Wav:
        from transformers import AutoConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav as HFCode2Wav

        # "auto" is not the checkpoint's bf16: the output is audio samples, where half precision is
        # audible; float32 weights, computed with TF32 on CUDA (float32 math: `dtype: float32`).
        mode = resolve_precision(dtype, precision, device)
        config = AutoConfig.from_pretrained(model_path)
        c2w_config = getattr(config, "code2wav_config", None)
        if c2w_config is None:
            raise ValueError(f"{model_path}: config has no code2wav_config (not a Qwen3-Omni checkpoint?)")
        device = torch.device(device)
        with torch.device(device):  # random init (overwritten below) is much faster on a GPU
            module = HFCode2Wav(c2w_config)
        if load_format != "dummy":  # dummy: keep the random init (benchmarks)
            module.load_state_dict(prefixed_tensors(model_path, WEIGHT_PREFIX), strict=True)
        module = module.to(torch.bfloat16 if mode is Precision.BFLOAT16 else torch.float32)
        return cls(module.eval(), device, mode, stream_config, compile_mode, cuda_graphs)

    # ------------------------------------------------------------------ whole requests
    @torch.inference_mode()
    def generate_batch(self, inputs: list[StageRequest]) -> list[dict[str, torch.Tensor]]:
        codes = [self._codes(req) for req in inputs]
        pieces: list[list[torch.Tensor]] = [[] for _ in inputs]
        longest = max((c.shape[1] for c in codes), default=0)
        for start in range(0, longest, CHUNK_FRAMES):  # transformers' chunked_decode, rows batched
            rows = [i for i, c in enumerate(codes) if c.shape[1] > start]
            context = LEFT_CONTEXT_FRAMES if start > LEFT_CONTEXT_FRAMES else start
            windows = [codes[i][:, start - context: start + CHUNK_FRAMES] for i in rows]
            for i, wav in zip(rows, self._decode_windows(windows)):
                pieces[i].append(wav[context * self.samples_per_frame:])
        # The rate travels with the audio, as Qwen2.5-Omni's does, so callers (CLI, server) can
        # encode it without knowing the model; a 0-dim tensor is metadata, never concatenated.
        rate = torch.tensor(self.sample_rate, dtype=torch.int32)
        return [{"audio": torch.cat(p).cpu() if p else torch.zeros(0), "sample_rate": rate} for p in pieces]

    def _codes(self, req: StageRequest) -> torch.Tensor:
        return prompt_frames(req, self.num_quantizers, self.codebook_size)

    # ------------------------------------------------------------------ streaming
    def open_stream(self, req: StageRequest) -> Code2WavStream:
        stream = Code2WavStream(req.request_id, self.num_quantizers, self.codebook_size, self.stream_config)
        first = self._codes(req)
        if first.shape[1]:
            stream.push(first.T, final=False)
        return stream

    @torch.inference_mode()
    def decode_streams(self, decoders: list[StreamingDecoder]) -> list[dict[str, torch.Tensor]]:
        streams = own_streams(decoders, Code2WavStream)
        windows = [s.next_window() for s in streams]
        forward = self._stream_forward if self.graphs is None else self.graphs.for_streams(streams)
        outputs = []
        wavs = self._decode_windows([w.codes for w in windows], [w.context for w in windows], forward)
        for stream, window, wav in zip(streams, windows, wavs):
            stream.commit(window)
            outputs.append(chunk_output(stream, wav, self.sample_rate))
        return outputs

    def streams_per_step(self, decoders: list[StreamingDecoder]) -> int:
        return streams_within_budget(self.graphs, own_streams(decoders, Code2WavStream))

    def _new_samples_from(self, context: int, skip_frames: int) -> int:
        """Where a window's new samples start in its decode from frame `skip_frames`: the previous
        chunk stopped `unfinished_samples` short of its end, and this window's context frames
        decode those again, now with the frame they were waiting for."""
        return (context - skip_frames) * self.samples_per_frame - self.unfinished_samples if context else 0

    # ------------------------------------------------------------------ the decoder calls
    def _decode_windows(self, windows: list[torch.Tensor], contexts: list[int] | None = None,
                        stream_forward=None) -> list[torch.Tensor]:
        """Waveforms of code windows [num_quantizers, n_i] (float32 on the device, n_i *
        samples_per_frame - unfinished_samples each), in as few right-padded calls as
        `plan_padded_calls` allows.

        With `contexts` (streams: each window's frames of left context), each waveform is only
        its window's new samples, from `stream_forward(codes, skip_frames)`, which may pad a call
        further (DecoderGraphs) and starts the vocoder where every row of the call has
        `vocoder_context_frames` frames of context."""
        lengths = [w.shape[1] for w in windows]
        spf, unfinished = self.samples_per_frame, self.unfinished_samples
        wavs: list[torch.Tensor] = [torch.zeros(0)] * len(windows)
        calls = plan_padded_calls(lengths, CALL_COST_FRAMES)
        # Every call's codes go to the device before the first call runs: a blocking copy waits
        # for its stream, so a copy between calls would hold the host until the calls before it
        # are done (a launched decode, worker/decode_lanes.py, would block its step).
        batches = [self._padded(windows, lengths, rows).to(self.device) for rows in calls]
        for rows, codes in zip(calls, batches):
            longest = lengths[rows[0]]
            skip = 0 if contexts is None else max(0, min(contexts[i] for i in rows) - self.vocoder_context_frames)
            with self.precision.scope(self.device):
                out = self._forward(codes) if contexts is None else stream_forward(codes, skip)
                out = out[:, 0].float()  # [rows, samples of frames skip..]
            if out.shape[1] < (longest - skip) * spf - unfinished:
                raise RuntimeError(f"code2wav: {out.shape[1]} samples for {longest - skip} frames; expected at "
                                   f"least {longest - skip} * {spf} - {unfinished}")
            for slot, i in enumerate(rows):
                start = 0 if contexts is None else self._new_samples_from(contexts[i], skip)
                # A copy: not a view of a graph's output buffer, which the next replay overwrites.
                wavs[i] = out[slot, start: (lengths[i] - skip) * spf - unfinished].clone()
        return wavs

    def _padded(self, windows: list[torch.Tensor], lengths: list[int], rows: list[int]) -> torch.Tensor:
        """The windows of these rows, right-padded with code 0 to the first (longest) one."""
        batch = torch.zeros(len(rows), self.num_quantizers, lengths[rows[0]], dtype=torch.long)
        for slot, i in enumerate(rows):
            batch[slot, :, : lengths[i]] = windows[i]
        return batch

    def _decode_from(self, codes: torch.Tensor, skip_frames: int = 0) -> torch.Tensor:
        """transformers' `Qwen3OmniMoeCode2Wav.forward` with the vocoder starting at frame
        `skip_frames`: codes [B, Q, T] -> [B, 1, (T - skip_frames) * samples_per_frame -
        unfinished_samples], the samples of frames skip_frames.. . Those from `unfinished_samples`
        before frame skip_frames + vocoder_context_frames on are the whole window's; earlier ones
        read the vocoder's zero padding instead of earlier frames."""
        m = self.module
        if codes.shape[1] != self.num_quantizers:
            raise ValueError(f"expected {self.num_quantizers} code groups, got {codes.shape[1]}")
        hidden = m.code_embedding(codes + m.code_offset).mean(1)
        hidden = m.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
        for blocks in m.upsample:  # transposed convolution (kernel = stride) + ConvNeXt block
            for block in blocks:
                hidden = block(hidden)
        hidden = hidden[..., skip_frames * self.vocoder_input_per_frame:]
        return run_layers(m.decoder, hidden).clamp(-1, 1)  # the vocoder: 94% of a 50-frame window's FLOPs


def _unfinished_samples(upsample_rates: list[int]) -> int:
    """Samples a window of n frames lacks at its end (n * samples_per_frame - output length).

    Each decoder block's transposed convolution (kernel 2 * rate) drops its last input step,
    `rate` outputs; later blocks multiply what was lost before. The ConvNeXt upsampling
    (kernel = stride) loses nothing. 555 samples (23 ms) for the released (8, 5, 4, 3).
    """
    tail = 0
    for rate in upsample_rates:
        tail = (tail + 1) * rate
    return tail


def _vocoder_layers(decoder: torch.nn.Module) -> list[CausalConvLayer | TransConvLayer]:
    """The vocoder's convolutions in the order they run, for `context_frames`: the modules
    register each block's, and each residual unit's branch's, in that order (a residual skip
    adds no reach). Its transposed convolutions trim kernel - stride samples on both sides."""
    layers: list[CausalConvLayer | TransConvLayer] = []
    for layer in decoder.modules():
        if isinstance(layer, CausalConv):
            layers.append(CausalConvLayer(layer.stride, layer.left))
        elif isinstance(layer, CausalTransConv):
            layers.append(TransConvLayer(layer.conv.kernel_size[0], layer.conv.stride[0], layer.trim_left))
    return layers


def _own_vocoder_layers(module: torch.nn.Module) -> None:
    """Our vocoder layers (layers/vocoder.py: the same parameters and math, fewer passes over the
    signal, SnakeBeta one fused kernel on CUDA) in place of transformers' in the module, each
    with the parameters, dtype, device and mode of the one it replaces."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    def ours(layer: torch.nn.Module) -> torch.nn.Module | None:
        if isinstance(layer, hf.Qwen3OmniMoeSnakeBeta):
            return SnakeBeta(layer.in_features)
        if isinstance(layer, hf.Qwen3OmniMoeCode2WavDecoderResidualUnit):
            return ResidualUnit(layer.conv1.conv.in_channels, layer.conv1.dilation)
        if isinstance(layer, hf.Qwen3OmniMoeCausalConvNet):
            c = layer.conv
            return CausalConv(c.in_channels, c.out_channels, c.kernel_size[0], c.dilation[0], c.stride[0], c.groups)
        if isinstance(layer, hf.Qwen3OmniMoeCausalTransConvNet):
            c = layer.conv
            return CausalTransConv(c.in_channels, c.out_channels, c.kernel_size[0], c.stride[0], layer.left_pad)
        return None

    swaps = [(parent, name, child, new) for parent in module.modules() for name, child in parent.named_children()
             if (new := ours(child)) is not None]
    for parent, name, child, new in swaps:
        weight = next(child.parameters())
        new = new.to(device=weight.device, dtype=weight.dtype).train(child.training)
        new.load_state_dict(child.state_dict())
        parent.add_module(name, new)
