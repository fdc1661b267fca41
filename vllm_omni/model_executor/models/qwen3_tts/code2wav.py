"""Qwen3-TTS code2wav stage: codec frames -> 24 kHz waveform (a GenerationModel).

Decodes with our `SpeechDecoder` (speech_decoder.py) loaded from the checkpoint's
speech_tokenizer/ folder, the way qwen-tts' tokenizer `decode` does: chunks of 300 frames
with 25 frames of left context. Input: a request's prompt_token_ids are its frames flattened
codebook-major (the talker2code2wav bridge); `additional_information["context_frames"]` leading
frames are the voice-cloning reference, decoded for context and cut from the audio the way
qwen-tts cuts them.

Requests of any lengths share one batch: the decoder is causal, so frames past a request's end
(padding) cannot change its samples; each waveform is cut at its own length.

Streaming (a talker -> code2wav edge with async_chunk): `open_stream` / `decode_streams` decode
a request's frames as the talker makes them, in the chunks of Qwen3-Omni's code2wav
(models/code2wav_stream.py: a small first chunk, then each chunk as long as all before
it up to 25 frames, each with 25 frames of left context; the connector's `codec_*` options set
them). The decoder is causal and keeps no look-ahead samples (its transposed convolutions drop
them), so a chunk's samples are final when decoded. A cloned voice's reference frames come
first in the stream as the first chunk's left context: its first chunk is its first generated
frames (the whole-request path decodes the reference too and cuts its share of the audio in
qwen-tts' float arithmetic).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_omni.model_executor.models.codec_streaming import (
    Precision, chunk_output, own_streams, prompt_frames, resolve_precision,
)
from vllm_omni.model_executor.models.decoder_graphs import StreamGraphs, streams_within_budget
from vllm_omni.model_executor.models.generation_model import GenerationModel
from vllm_omni.model_executor.models.code2wav_stream import Code2WavStream, Code2WavStreamConfig
from vllm_omni.model_executor.models.qwen3_tts.speech_decoder import SpeechDecoder
from vllm_omni.stage_io import StageRequest, StreamingDecoder

CONTEXT_FRAMES_KEY = "context_frames"
DECODER_PREFIX = "decoder."
CHUNK_FRAMES, LEFT_CONTEXT_FRAMES = 300, 25  # qwen-tts' chunked_decode defaults


class Qwen3TTSCode2Wav(GenerationModel):
    """`generate_batch` / `decode_streams` -> [{"audio": float32 [N], "sample_rate": int32 []}]
    (a stream's chunks carry the rate in the first one only)."""

    stream_options_type = Code2WavStreamConfig  # load(stream_config=...) from the input connector's options
    supports_cuda_graphs = True  # load(cuda_graphs=not enforce_eager)
    accepts_streamed_input = True
    overlaps_first_chunks = True  # first chunks have graphs of their own; nothing else is shared

    def __init__(self, decoder: SpeechDecoder, device: torch.device, sample_rate: int,
                 stream_config: Code2WavStreamConfig | None = None, cuda_graphs: bool = False,
                 precision: Precision = Precision.FLOAT32) -> None:
        self.decoder = decoder
        self.device = device
        self.precision = precision
        self.sample_rate = sample_rate
        self.stream_config = stream_config or Code2WavStreamConfig()
        self.max_units_per_chunk = max(self.stream_config.initial_chunk_frames, self.stream_config.chunk_frames)
        # Streamed chunks of a few requests are launch-bound: replayed graphs (the decoder is causal,
        # its rows independent), first chunks from graphs of their own (StreamGraphs).
        self.graphs: StreamGraphs | None = None
        if cuda_graphs:
            self.graphs = StreamGraphs(decoder, decoder.num_quantizers, decoder.samples_per_frame, self.stream_config,
                                       decoder.vocoder_context_frames)
            with self.precision.scope(self.device):
                self.graphs.capture_all(device)

    @classmethod
    def load(cls, model_path: str, *, model_stage: str | None = None, device: torch.device | str = "cpu",
             dtype: str = "auto", load_format: str = "auto", precision: str | None = None,
             stream_config: Code2WavStreamConfig | None = None, cuda_graphs: bool = False) -> Qwen3TTSCode2Wav:
        device = torch.device(device)
        # "auto" is float32 weights (half precision is audible in the samples), TF32 math on CUDA.
        mode = resolve_precision(dtype, precision, device)
        folder = Path(model_path) / "speech_tokenizer"
        if not (folder / "config.json").is_file():
            raise ValueError(f"{model_path}: no speech_tokenizer/config.json (the 12 Hz codec of Qwen3-TTS)")
        config = json.loads((folder / "config.json").read_text())
        with torch.device(device):
            decoder = SpeechDecoder(config["decoder_config"])
        decoder = decoder.to(torch.bfloat16 if mode is Precision.BFLOAT16 else torch.float32)
        if load_format != "dummy":
            tensors = {k[len(DECODER_PREFIX):]: v for k, v in load_file(str(folder / "model.safetensors")).items()
                       if k.startswith(DECODER_PREFIX)}
            decoder.load_state_dict(tensors, strict=True)
        return cls(decoder.eval(), device, int(config.get("output_sample_rate", 24000)), stream_config,
                   cuda_graphs=cuda_graphs and device.type == "cuda", precision=mode)

    @torch.inference_mode()
    def generate_batch(self, inputs: list[StageRequest]) -> list[dict[str, torch.Tensor]]:
        codes = [self._codes(req) for req in inputs]
        lengths = [c.shape[1] for c in codes]
        wavs = [torch.zeros(0, dtype=torch.float32) for _ in inputs]
        live = [i for i, n in enumerate(lengths) if n > 0]
        if live:
            batch = torch.zeros(len(live), self.decoder.num_quantizers, max(lengths[i] for i in live),
                                dtype=torch.long)
            for row, i in enumerate(live):
                batch[row, :, : lengths[i]] = codes[i]
            with self.precision.scope(self.device):
                out = self.decoder.chunked_decode(batch.to(self.device), CHUNK_FRAMES, LEFT_CONTEXT_FRAMES)
            out = out.float().cpu()
            spf = self.decoder.samples_per_frame
            for row, i in enumerate(live):
                wav = out[row, : lengths[i] * spf]
                context = int(inputs[i].additional_information.get(CONTEXT_FRAMES_KEY, 0))
                # qwen-tts' cut of the reference's share of the audio (float arithmetic and all).
                cut = int(context / max(lengths[i], 1) * wav.shape[0]) if context else 0
                wavs[i] = wav[cut:].clone()
        rate = torch.tensor(self.sample_rate, dtype=torch.int32)
        return [{"audio": wav, "sample_rate": rate} for wav in wavs]

    @property
    def num_quantizers(self) -> int:
        return self.decoder.num_quantizers

    @property
    def codebook_size(self) -> int:
        return self.decoder.codebook_size

    # ------------------------------------------------------------------ streaming
    def open_stream(self, req: StageRequest) -> Code2WavStream:
        # A cloned voice's reference frames are the first chunk's left context, not chunks of their own.
        stream = Code2WavStream(req.request_id, self.decoder.num_quantizers, self.decoder.codebook_size,
                                self.stream_config, int(req.additional_information.get(CONTEXT_FRAMES_KEY, 0)))
        first = self._codes(req)
        if first.shape[1]:
            stream.push(first.T, final=False)
        return stream

    def streams_per_step(self, decoders: list[StreamingDecoder]) -> int:
        return streams_within_budget(self.graphs, own_streams(decoders, Code2WavStream))

    @torch.inference_mode()
    def decode_streams(self, decoders: list[StreamingDecoder]) -> list[dict[str, torch.Tensor]]:
        streams = own_streams(decoders, Code2WavStream)
        windows = [s.next_window() for s in streams]
        # Right padding cannot reach a row's samples (the decoder is causal): one call for all.
        longest = max(w.codes.shape[1] for w in windows)
        batch = torch.zeros(len(windows), self.decoder.num_quantizers, longest, dtype=torch.long)
        for row, window in enumerate(windows):
            batch[row, :, : window.codes.shape[1]] = window.codes
        # The vocoder needs less context than the transformer: it starts where every row has enough.
        skip = max(0, min(w.context for w in windows) - self.decoder.vocoder_context_frames)
        decode = self.decoder if self.graphs is None else self.graphs.for_streams(streams)
        with self.precision.scope(self.device):
            wavs = decode(batch.to(self.device), skip)[:, 0].float()
        spf, outputs = self.decoder.samples_per_frame, []
        for stream, window, wav in zip(streams, windows, wavs):
            stream.commit(window)
            chunk = wav[(window.context - skip) * spf: (window.codes.shape[1] - skip) * spf]
            # On the device (the engine copies it out), and not a view of a graph's output buffer.
            outputs.append(chunk_output(stream, chunk.clone(), self.sample_rate))
        return outputs

    def _codes(self, req: StageRequest) -> torch.Tensor:
        return prompt_frames(req, self.decoder.num_quantizers, self.decoder.codebook_size)
