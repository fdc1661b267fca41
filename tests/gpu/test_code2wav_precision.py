"""Code2wav fast paths on the GPU against the float32 eager path.

Random weights of the real architectures (`load_format="dummy"`, the same seed for both sides)
for the precision tolerances; the tiny checkpoints for exactness of the GPU paths. The
tolerances are SNR of the fast waveform against the float32 one: random weights clip and
ring more than trained ones, so these are floors, not quality claims. bfloat16 was measured on
the CPU with the real architectures: Qwen3 decoder 27 dB, Qwen2.5 (DiT in bf16, 4 steps) 51 dB.
TF32 keeps 3 more mantissa bits than bfloat16 (8x smaller rounding, ~18 dB more), not measured.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.models.codec_streams import audio_of, open_empty, run_stream, snr_db  # noqa: E402
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav  # noqa: E402
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_code2wav import Qwen3OmniMoeCode2Wav  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts.code2wav import Qwen3TTSCode2Wav  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402
from vllm_omni.stage_io import StageRequest  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
FAMILIES = {"qwen3": (Qwen3OmniMoeCode2Wav, "qwen3_omni_30b_a3b.json", "qwen3_omni_moe"),
            "qwen2_5": (Qwen2_5OmniToken2Wav, "qwen2_5_omni_7b.json", "qwen2_5_omni")}
REAL_ARCH = {**FAMILIES, "qwen3_tts": (Qwen3TTSCode2Wav, "qwen3_tts_tokenizer_12hz.json", None)}
MIN_SNR_DB = {("qwen3", "bfloat16"): 20.0, ("qwen3", "tf32"): 35.0,
              ("qwen2_5", "bfloat16"): 40.0, ("qwen2_5", "tf32"): 50.0,
              ("qwen3_tts", "bfloat16"): 20.0, ("qwen3_tts", "tf32"): 35.0}


@pytest.fixture(scope="module")
def real_dirs(tmp_path_factory):
    from vllm_omni.testing.dummy_checkpoints import make_dummy_omni_checkpoint

    dirs = {family: make_dummy_omni_checkpoint(CONFIGS / config, tmp_path_factory.mktemp(family))
            for family, (_, config, _) in FAMILIES.items()}
    # Qwen3-TTS's decoder needs only the speech tokenizer's config for dummy weights.
    dirs["qwen3_tts"] = tmp_path_factory.mktemp("qwen3_tts")
    (dirs["qwen3_tts"] / "speech_tokenizer").mkdir()
    shutil.copy(CONFIGS / REAL_ARCH["qwen3_tts"][1], dirs["qwen3_tts"] / "speech_tokenizer" / "config.json")
    return dirs


def requests(family: str, seconds: list[float]) -> list[StageRequest]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, s in enumerate(seconds):
        ids = (torch.randint(0, 2048, (16 * round(12.5 * s),), generator=g) if family != "qwen2_5"
               else torch.randint(0, 8193, (round(50 * s),), generator=g))
        out.append(StageRequest(request_id=f"r{i}", prompt_token_ids=ids.tolist(), sampling_params=SamplingParams(seed=i)))
    return out


def load_real(family: str, path, precision: str):
    torch.manual_seed(0)  # dummy weights: the same random init for every precision
    return REAL_ARCH[family][0].load(str(path), device="cuda", load_format="dummy", precision=precision)


@pytest.mark.parametrize("precision", ["tf32", "bfloat16"])
@pytest.mark.parametrize("family", list(REAL_ARCH))
def test_fast_precision_within_tolerance_of_float32(real_dirs, family, precision):
    reqs = requests(family, [2.0, 3.5])
    reference = load_real(family, real_dirs[family], "float32").generate_batch(reqs)
    fast = load_real(family, real_dirs[family], precision).generate_batch(reqs)
    for ref, got in zip(reference, fast):
        snr = snr_db(ref["audio"], got["audio"])
        print(f"{family} {precision}: SNR {snr:.1f} dB against float32")
        assert got["audio"].shape == ref["audio"].shape and snr >= MIN_SNR_DB[family, precision]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_float32_matches_cpu_and_ignores_batch_mates(tiny_model, family):
    """float32 on the GPU (TF32 off) is the CPU's float32 up to rounding, whole and streamed,
    and a request's audio alone equals it in a mixed-length batch."""
    cls, _, tiny = FAMILIES[family]
    path = str(tiny_model(tiny))
    cpu, gpu = cls.load(path), cls.load(path, device="cuda", dtype="float32")  # "auto" is TF32 on CUDA
    reqs = requests_tiny(family)
    batch = gpu.generate_batch(reqs)
    for req, on_cpu, on_gpu in zip(reqs, cpu.generate_batch(reqs), batch):
        torch.testing.assert_close(on_gpu["audio"], on_cpu["audio"], atol=1e-4, rtol=0)
        [alone] = gpu.generate_batch([req])
        torch.testing.assert_close(on_gpu["audio"], alone["audio"], atol=1e-5, rtol=0)
    units = stream_units(family, reqs[-1])
    torch.testing.assert_close(torch.cat(audio_of(run_stream(gpu, open_empty(gpu, seed=0), units))),
                               torch.cat(audio_of(run_stream(cpu, open_empty(cpu, seed=0), units))), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_matches_eager(tiny_model, family):
    cls, _, tiny = FAMILIES[family]
    path = str(tiny_model(tiny))
    reqs = requests_tiny(family)
    # TF32: Inductor's fused elementwise kernels would round apart from eager ones in bfloat16.
    eager = cls.load(path, device="cuda", precision="tf32")
    compiled = cls.load(path, device="cuda", precision="tf32", compile_mode="default")
    eager, compiled = eager.generate_batch(reqs), compiled.generate_batch(reqs)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b["audio"], a["audio"], atol=1e-4, rtol=0)


def requests_tiny(family: str) -> list[StageRequest]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, n in enumerate((9, 40, 75)):
        ids = torch.randint(0, 64, (4 * n,), generator=g) if family == "qwen3" else torch.randint(0, 124, (n,), generator=g)
        out.append(StageRequest(request_id=f"t{i}", prompt_token_ids=ids.tolist(), sampling_params=SamplingParams(seed=0),
                                additional_information={} if family == "qwen3" else {"num_steps": 4}))
    return out


def stream_units(family: str, req: StageRequest) -> torch.Tensor:
    ids = torch.tensor(req.prompt_token_ids)
    return ids.view(4, -1).T if family == "qwen3" else ids


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_dit_graphs_equal_the_eager_dit(real_dirs, precision, monkeypatch):
    """token2wav's DiT evaluations replayed from CUDA graphs (token2wav_graphs.py) give the eager
    waveforms, whole requests and a stream's windows, captured on first use then replayed."""
    from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_dit import forward_cfg
    from vllm_omni import envs
    from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_graphs import DiTGraphs

    fast = load_real("qwen2_5", real_dirs["qwen2_5"], precision)
    monkeypatch.setenv(envs.DIT_CUDA_GRAPHS.name, "0")
    eager = load_real("qwen2_5", real_dirs["qwen2_5"], precision)
    assert isinstance(fast._dit_forward, DiTGraphs) and eager._dit_forward is forward_cfg
    reqs = requests("qwen2_5", [1.0, 1.6])
    for _ in range(2):  # the second call replays what the first captured
        got = fast.generate_batch(reqs)
    # float32: the same samples. bfloat16: the captured and the eager evaluations round apart in
    # the last bits (measured 1.4e-4 max abs on the H200: the graph casts weights inside each
    # replay, and cuBLAS may choose other kernels under capture), far below bf16's own error.
    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        if precision == "float32":
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            assert snr_db(want, got) >= 60.0

    for a, b in zip(got, eager.generate_batch(reqs)):
        check(a["audio"], b["audio"])
    codes = torch.tensor(reqs[1].prompt_token_ids)
    streamed = [audio_of(run_stream(m, open_empty(m, seed=1), codes, [40, 20, len(codes) - 60])) for m in (fast, eager)]
    assert len(fast._dit_forward.captured) > 2  # whole rows, then the stream's window shapes
    check(torch.cat(streamed[0]), torch.cat(streamed[1]))


FUSED_MIN_SNR_DB = {"float32": 80.0, "bfloat16": 25.0}  # against torch's ops in the same precision


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_tts", "qwen2_5"])
def test_fused_vocoder_layers_give_the_torch_samples(real_dirs, family, precision, monkeypatch):
    """The vocoders' fused layers (layers/vocoder.py: SnakeBeta adding the previous conv's bias
    and writing the next conv's padding, the residual sum with the bias, transposed convs as a
    GEMM; Qwen2.5's BigVGAN: each anti-aliased SnakeBeta as one kernel) against torch's ops:
    whole requests and streamed windows (real architectures, 2 and 3.5 s). The element-wise
    kernels give torch's bits (test_cuda_ops.py); the GEMM and the anti-aliasing filters sum in
    another order than cuDNN, hence an SNR floor (measured values printed)."""
    from vllm_omni import envs

    fused = load_real(family, real_dirs[family], precision)
    monkeypatch.setenv(envs.FUSED_VOCODER.name, "0")
    plain = load_real(family, real_dirs[family], precision)
    reqs = requests(family, [2.0, 3.5])
    units = torch.tensor(reqs[1].prompt_token_ids)
    units = units if family == "qwen2_5" else units.view(16, -1).T
    pairs = [(a["audio"], b["audio"]) for a, b in zip(fused.generate_batch(reqs), plain.generate_batch(reqs))]
    pairs.append((torch.cat(audio_of(run_stream(fused, open_empty(fused, seed=1), units))),
                  torch.cat(audio_of(run_stream(plain, open_empty(plain, seed=1), units)))))
    for got, want in pairs:
        snr = snr_db(want, got)
        print(f"{family} {precision}: fused vocoder layers {snr:.1f} dB against torch's ops")
        assert got.shape == want.shape and snr >= FUSED_MIN_SNR_DB[precision]
