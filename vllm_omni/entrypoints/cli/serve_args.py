"""The flags of `vllm-omni serve` / `vllm serve --omni`: every OmniConfig flag of spec 001 with
its documented default, plus the server and engine flags.

A flag is either implemented or refused: a refused flag is parsed (so its documented default
and help show in --help), and any value other than its default stops the server at startup
with a message naming the flag and why (DESIGN 6: never silently ignored).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.config.schema import AR_FIELDS, DIFFUSION_FIELDS
from vllm_omni.entrypoints.cli import stage_cli
from vllm_omni.entrypoints.openai import input_limits, tts_limits, video_store
from vllm_omni.entrypoints.openai.chat_options import parse_mm_limits
from vllm_omni.entrypoints.openai.realtime import limits as realtime_limits


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    help: str
    kwargs: dict[str, Any] = field(default_factory=dict)  # argparse: default, type, choices, action...
    refused: str | None = None  # why a non-default value is refused; None: implemented
    attribute: str | None = None  # the attribute it sets, when its name says the opposite (--disable-...)

    @property
    def dest(self) -> str:
        # The long spelling names the attribute (--usp / --ulysses-degree -> ulysses_degree).
        return self.attribute or max((n for n in self.names if n.startswith("--")), key=len).lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        return self.kwargs.get("default")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _f(names: str, help: str, refused: str | None = None, **kwargs: Any) -> Flag:
    return Flag(tuple(names.split()), help, kwargs, refused)


def _bool(names: str, help: str, refused: str | None = None, default: Any = False) -> Flag:
    return _f(names, help, refused, action="store_true", default=default)


OMNI_FLAGS: tuple[Flag, ...] = (
    _bool("--omni", "Enable vLLM-Omni mode for multi-modal and diffusion models (required by `vllm serve`; "
          "`vllm-omni serve` is always in omni mode)."),
    _bool("--enable-sleep-mode", "Enable sleep mode: POST /sleep?level=1|2 frees the stages' device memory (level 1 "
          "keeps the weights in CPU memory, level 2 reloads them from the checkpoint), POST /wake_up restores it, GET "
          "/is_sleeping tells; without this flag those routes do not exist (404). docs/operations.md, 'Sleep mode'."),
    _f("--task-type", "Task type of a TTS model (CustomVoice, VoiceDesign or Base); default: inferred from the "
       "checkpoint, which must match.", choices=("CustomVoice", "VoiceDesign", "Base"), default=None),
    _f("--stage-configs-path", "[Deprecated] Path to a legacy stage configs YAML (stage_args format). Prefer "
       "--deploy-config for new-format deploy YAMLs.", default=None),
    _f("--deploy-config", "Path to a deploy config YAML (new format with stages/engine_args). Mutually exclusive "
       "with --stage-configs-path.", default=None),
    _f("--stage-overrides", "Per-stage JSON overrides, e.g. '{\"0\": {\"gpu_memory_utilization\": 0.8}}'.",
       default=None),
    _f("--async-chunk", "Override the deploy YAML's async_chunk: bool. Unset leaves the YAML value in force.",
       action=argparse.BooleanOptionalAction, default=None),
    _f("--stage-id", "Select and launch a single stage by stage_id (the stage-based CLI: engine flags apply to "
       "this stage alone; the head's other stages register as --headless processes; docs/deployment.md).",
       type=int, default=None),
    _f("--replica-id", "Deprecated and ignored: replica ids are auto-assigned by the master server. Specifying "
       "it prints a warning and has no effect.", type=int, default=None),
    _f("--stage-init-timeout", "The timeout for initializing a single stage, in seconds.", type=float, default=300),
    _f("--init-timeout", "The timeout for initializing all the stages, in seconds.", type=float, default=600),
    _f("--shm-threshold-bytes", "Tensors larger than this travel between processes through shared memory.",
       type=int, default=65536),
    _bool("--log-stats", "Log per-request stage timings and per-stage counters."),
    _f("--log-file", "Also write the server's log to this file.", default=None),
    _f("--batch-timeout", "The timeout for the batch: the longest a request waits in the server's admission "
       "queue (see --max-concurrent-requests) before it is answered 429, in seconds.", type=float, default=10),
    _f("--worker-backend", "The backend to use for stage workers: multi_process (a spawned process per stage) "
       "or ray (a Ray actor per stage, on this host; needs the ray extra).",
       choices=("multi_process", "ray"), default="multi_process"),
    _f("--ray-address", "The address of the Ray cluster to connect to (with --worker-backend ray), e.g. auto "
       "(the cluster `ray start` began on this host) or HOST:PORT. Unset: the cluster RAY_ADDRESS names, else a "
       "local Ray instance the server starts and stops.", default=None),
    _f("--omni-master-address -oma", "Hostname or IP address of the Omni orchestrator (master): the head "
       "listens there for headless stages, which register there.", default=None),
    _f("--omni-master-port -omp", "Port of the Omni orchestrator (master).", type=int, default=None),
    _f("--omni-replica-address -ora", "Local bind address that a headless stage advertises to the Omni master. "
       "Unset: this host's address on the route to --omni-master-address.", default=None),
    _f("--omni-dp-size-local", "Number of stage replicas this runtime launches locally for its --stage-id. "
       "Without --stage-id it applies to every stage, like the other engine flags (per stage: runtime.num_replicas "
       "in the config or --stage-overrides '{\"1\": {\"num_replicas\": 2}}', which wins); see docs/deployment.md.", type=int,
       default=1),
    _f("--omni-lb-policy", "Per-stage load-balancing policy: which UP replica of a stage takes a new request.",
       choices=("random", "round-robin", "least-queue-length"), default="random"),
    _f("--omni-heartbeat-timeout", "Seconds without a heartbeat before a stage is declared down (its requests "
       "fail, /health answers 503); one that speaks again is back at once, one still silent after 3x as long is "
       "killed and restarted. (Spec 001 documents 30.0; stages here send a heartbeat 4 times per timeout, at most "
       "every second, from a thread of their own, so a few seconds detect a frozen stage without mistaking a long "
       "step for one.)", type=float, default=3.0),
    _f("--num-gpus", "Number of GPUs to use for diffusion model inference: the diffusion stage's world size, "
       "which must equal cfg_parallel_size x ulysses x ring (x standalone HSDP).", type=int, default=None),
    _f("--model-class-name", "Override the diffusion pipeline class name (a native pipeline such as "
       "QwenImagePipeline, or with --diffusion-load-format diffusers any diffusers pipeline class).", default=None),
    _f("--diffusion-load-format", "How to load the diffusion pipeline: default (our engine), dummy (our engine, "
       "random weights) or diffusers (any diffusers pipeline, one whole call per request). custom_pipeline is not "
       "supported.", choices=("default", "custom_pipeline", "dummy", "diffusers"), default=None),
    _f("--diffusers-load-kwargs", "JSON object passed to DiffusionPipeline.from_pretrained() (diffusers load "
       "format); it overrides the matching settings of vLLM-Omni (e.g. torch_dtype).", type=_json_object,
       default={}),
    _f("--diffusers-call-kwargs", "JSON object passed to pipeline.__call__() (diffusers load format); a "
       "request's own parameters override it.", type=_json_object, default={}),
    _f("--usp --ulysses-degree", "Ulysses Sequence Parallelism degree for diffusion models (all-to-all over "
       "heads; docs/diffusion.md, Parallelism).", type=int, default=None),
    _f("--ulysses-mode", "Ulysses sequence-parallel mode for diffusion models: 'strict' needs heads and sequence "
       "lengths divisible by the degrees; 'advanced_uaa' pads heads and splits sequences unevenly.",
       choices=("strict", "advanced_uaa"), default="strict"),
    _f("--ring --ring-degree", "Ring Sequence Parallelism degree for diffusion models (K/V blocks passed around a "
       "ring, partial outputs merged by log-sum-exp); with --usp: Ulysses inside, ring across.", type=int,
       default=None),
    _f("--diffusion-quantization-config", "JSON object of the diffusion transformer's quantization: "
       "'{\"method\": \"fp8\"}' (online FP8 weights, per-channel scales, per-token activations) or "
       "'{\"method\": \"gguf\", \"gguf_model\": \"/path/to/model.gguf\"}'.", type=_json_object, default=None),
    _bool("--force-cutlass-fp8", "Diffusion FP8 weights (online or a ModelOpt FP8 checkpoint) must run on the FP8 "
          "GEMM (torch._scaled_mm: CUDA, compute capability 8.9+, bfloat16); without it they fall back to a "
          "dequantized product where it cannot run. Refused where it cannot run or without FP8 weights.",
          default=None),
    _bool("--use-hsdp", "Enable HSDP (Hybrid Sharded Data Parallel) for diffusion models: the transformer blocks' "
          "weights sharded with FSDP2, gathered block by block in each forward."),
    _f("--hsdp-shard-size", "Number of GPUs to shard weights across (-1: auto, the world / replicate size).",
       type=int, default=-1),
    _f("--hsdp-replicate-size", "Number of replica groups for HSDP.", type=int, default=1),
    _f("--diffusion-attention-backend", "Attention kernel of the diffusion transformer: TORCH_SDPA (PyTorch "
       "chooses), CUDNN_ATTN (cuDNN first) or FLASH_ATTN (PyTorch's FlashAttention-2 kernel). Default: CUDNN_ATTN "
       "on CUDA, TORCH_SDPA elsewhere. Shorthand of --diffusion-attention-config.default.backend.", default=None),
    _f("--diffusion-attention-config -dac", "Diffusion attention config per role (self, cross, joint): JSON, e.g. "
       "'{\"default\": {\"backend\": \"CUDNN_ATTN\"}, \"per_role\": {\"cross\": {\"backend\": "
       "\"TORCH_SDPA\", \"quant\": {\"method\": \"fp8\"}}}}', or dotted flags such as "
       "--diffusion-attention-config.per_role.self.backend FLASH_ATTN.", type=_json_object, default=None),
    _f("--cache-backend", "Cache backend for diffusion models: none, tea_cache or cache_dit (DBCache; mag_cache is "
       "not supported).", default="none"),
    _f("--cache-config", "JSON object of cache settings. TeaCache: '{\"rel_l1_thresh\": 0.2}' (and optionally "
       "\"coefficients\": 5 numbers). cache_dit: cache-dit's DBCache keys, e.g. '{\"Fn_compute_blocks\": 1, "
       "\"residual_diff_threshold\": 0.24, \"steps_computation_mask\": [1, 1, 0, ...]}'.", type=_json_object,
       default=None),
    _bool("--enable-cache-dit-summary", "Log cache-dit's statistics (cached steps, residual diffs) per request."),
    _bool("--step-execution", "Enable per-step diffusion execution. Our diffusion engine always runs one "
          "denoising step at a time (requests join and abort between steps); accepted for compatibility."),
    _bool("--vae-use-slicing", "Enable VAE slicing (decode the images of a batch one at a time)."),
    _bool("--vae-use-tiling", "Enable VAE tiling (encode and decode large images in tiles)."),
    Flag(("--disable-multithread-weight-load",), "Read the checkpoint of AR stages on one thread (the default "
         "reads it with --num-weight-load-threads threads). The documented default, True, is the value of the "
         "setting it turns off, enable_multithread_weight_load.",
         {"action": "store_false", "default": True}, attribute="enable_multithread_weight_load"),
    _f("--num-weight-load-threads", "Threads that read an AR stage's safetensors checkpoint ahead of its loader "
       "(the tensors and their order are the same with any number).", type=int, default=4),
    _bool("--enable-cpu-offload", "Enable CPU offloading for diffusion models (the text encoder, the VAE and a "
          "two-expert video model's idle transformer wait on the CPU between their calls)."),
    _bool("--enable-layerwise-offload", "Enable layerwise (blockwise) offloading on DiT modules: each transformer "
          "block's weights wait in CPU memory and are copied to the device just before the block runs (the next "
          "block's while one computes), into a ring of two blocks' worth of device memory (per transformer: "
          "Qwen-Image's, each of Wan2.2's)."),
    _f("--boundary-ratio", "Boundary split ratio for low/high DiT in video models (Wan2.2 A14B: the high-noise "
       "transformer runs while timestep >= ratio * 1000; default: the checkpoint's model_index.json, 0.875 for "
       "T2V, 0.9 for I2V).", type=float, default=None),
    _f("--flow-shift", "Scheduler flow_shift for video models (default: the checkpoint's scheduler config; 5.0 for "
       "720p, 12.0 for 480p).", type=float, default=None),
    _f("--diffusion-kv-cache-dtype", "fp8: the diffusion attention's K and V pass through float8_e4m3fn (per-head "
       "scales) before the kernel. Separate from --kv-cache-dtype.", default=None),
    _f("--diffusion-kv-cache-skip-steps", "Denoising steps that keep K/V unquantized, e.g. '0-9,20,25-30'.",
       default=None),
    _f("--diffusion-kv-cache-skip-layers", "Transformer layers that keep K/V unquantized, e.g. '0,1,4-8'.",
       default=None),
    _f("--cfg-parallel-size", "Number of devices for CFG parallel computation (2: the unconditional branch on a "
       "second device).", type=int, choices=(1, 2), default=1),
    _f("--vae-patch-parallel-size", "VAE Patch Parallelism degree: the latent's rows split across that many of "
       "the stage's ranks for the VAE decode (with a halo, so the image is the one-process image).", type=int,
       default=1),
    _f("--default-sampling-params", "JSON default sampling parameters per stage, e.g. '{\"0\": "
       "{\"num_inference_steps\": 30}}' (diffusion models only; --stage-overrides wins).", type=_json_object,
       default=None),
    _f("--max-generated-image-size", "The max size of a generated image (height * width); larger requests are "
       f"answered 400. Unset: {input_limits.DEFAULT_GENERATED_IMAGE_PIXELS} pixels (2 megapixels) on the server.",
       type=int, default=None),
    _f("--tts-max-instructions-length", "Maximum length (characters) of TTS voice style instructions; longer "
       "ones get a 400 (default: 500).", type=int, default=None),
    _bool("--no-guardrails", "Disable Cosmos3 text/video safety guardrails.", "Cosmos3 is not supported"),
    _bool("--enable-diffusion-pipeline-profiler", "Report each request's prompt encoding, denoising and VAE decoding "
          "times (seconds) in stage_durations: the response's metrics and /metrics."),
    _bool("--enable-ar-profiler", "Report each request's time in every AR stage (queue, prefill, decode; seconds) in "
          "stage_durations: the response's metrics and /metrics."),
    _f("--auxiliary-text-encoder", "Auxiliary text encoder model name or path, for pipelines that take one "
       "(HiDream-I1's Llama encoder); refused for pipelines that take none (Qwen-Image, Wan2.2).", default=None),
)

SERVER_FLAGS: tuple[Flag, ...] = (
    _f("--host", "Address to listen on.", default="0.0.0.0"),
    _f("--port", "Port to listen on.", type=int, default=8000),
    _f("--api-key", "Require 'Authorization: Bearer <key>' on /v1 routes.", default=None),
    _f("--served-model-name", "Model name(s) clients use; the first is reported. Default: MODEL as given "
       "(vllm-omni-demo without MODEL).", nargs="+", default=None),
    _f("--allowed-local-media-path", "Allow media requests to read local files (file:// URLs, paths) under "
       "this folder. Default: local files are refused.", default=None),
    _f("--media-fetch-timeout", "Deadline for downloading one http(s) media URL, in seconds.", type=float,
       default=10.0),
    _f("--max-media-bytes", "Size limit of one downloaded media file.", type=int, default=64 * 1024 * 1024),
    _f("--max-request-bytes", "Size limit of a request body (inline base64 media included); larger is 413. "
       "The default carries about 48 MB of inline media (base64 adds a third).", type=int, default=64 * 1024 * 1024),
    _f("--max-prompts-per-request", "Prompts one /v1/completions request may hold (each is a request in the "
       "pipeline and takes an admission slot, at most all of them); more is 400.", type=int,
       default=32),
    _f("--allowed-media-domains", "Only fetch media URLs whose host is one of these domains (or a subdomain). "
       "Listed domains may resolve to private addresses; others never may.", nargs="+", default=None),
    _f("--allow-private-media-urls", "Let media URLs reach loopback, private, link-local and other internal "
       "addresses (refused by default: a client could make the server fetch from its own network).",
       action="store_true", default=False),
    _f("--shutdown-timeout", "On SIGTERM / SIGINT, how long requests in flight may take to finish before they are "
       "ended with an error, in seconds.", type=float, default=30.0),
    _f("--max-stage-restarts", "How many times a stage that dies or hangs is restarted (with backoff) before it "
       "stays down; the count starts over once a restarted stage has served for a minute. 0: never restart.",
       type=int, default=3),
    _f("--max-concurrent-requests", "Requests in the pipeline at once; more wait in the admission queue.",
       type=int, default=256),
    _f("--max-queued-requests", "Requests that may wait for admission; one more is answered 429 at once.",
       type=int, default=1024),
    _f("--admission-policy", "What a new audio request meets when the pipeline is at its playback load (the streams "
       "playing would run dry with one more; docs/streaming.md): queue (it waits, at most --batch-timeout, then "
       "429), reject (429 at once) or off (only the request-count limits).", choices=("queue", "reject", "off"),
       default="off"),
    _f("--admission-headroom", "Playback-load margin: a new audio request starts while the estimated load with it "
       "(GPU-seconds per second of the streams playing) is at most 1 minus this.", type=float, default=0.2),
    _f("--uvicorn-log-level", "uvicorn's log level.", choices=("critical", "error", "warning", "info", "debug",
       "trace"), default="info"),
    _bool("--headless", "Run stage --stage-id without the API server, for the head at --omni-master-address/"
          "--omni-master-port (stage-based CLI).", default=False),
    # vLLM's serve flags, upstream's older and streaming-shape flags (docs/compatibility.md).
    _f("--init-sleep-seconds", "[Deprecated: accepted and ignored] upstream v0.12's pause between starting "
       "stages; stages here start together and report when they are ready (see --stage-init-timeout).",
       type=int, default=None),
    _f("--chat-template", "The chat template to use instead of the model's: a file path, or the template "
       "itself.", default=None),
    _f("--limit-mm-per-prompt", "The most media items of each kind one request may carry, as JSON, e.g. "
       "'{\"image\": 2, \"video\": 1}'; more is a 400. Unset: no limit.", type=parse_mm_limits, default=None),
    _bool("--enable-log-requests", "Log every request (the access log)."),
    _bool("--disable-log-requests", "[Deprecated: requests are not logged unless --enable-log-requests] "
          "vLLM's old flag, accepted."),
    _f("--strategy-config", "Upstream's parallel strategy YAML (`strategies: {thinker: [{axis: tp, size: 2}]}`): "
       "tensor parallelism and replicas per model_stage, over the stage or deploy config; its stage_replica "
       "routing sets the replica load balancer.", default=None),
    _f("--forced-aligner", "Upstream's word timestamps for TTS: the Qwen3-ForcedAligner model.",
       "word timestamps with a forced aligner are not supported", default=None),
    _f("--forced-aligner-config", "Upstream's forced-aligner settings YAML (`forced_aligner:`).",
       "word timestamps with a forced aligner are not supported", default=None),
    _f("--audio-stream-shape", "Where streamed chat chunks carry audio: 'openai' puts it in delta.audio.data "
       "(OpenAI's shape); 'upstream' in delta.content, as upstream vLLM-Omni does, for clients written "
       "against it. Either way audio chunks are marked modality: \"audio\".",
       choices=("openai", "upstream"), default="openai"),
)

# Engine arguments applied to every stage (config precedence: --stage-overrides > these > YAML).
# None: not given, the stage config's value stays. Must match config.STAGE_CLI_FIELDS.
ENGINE_FLAGS: tuple[Flag, ...] = (
    _f("--gpu-memory-utilization", "Fraction of device memory for weights, activations and KV cache.",
       type=float, default=None),
    _bool("--enforce-eager", "Disable CUDA graphs.", default=None),
    _bool("--trust-remote-code", "Trust remote code in Hugging Face configs.", default=None),
    _f("--enable-prefix-caching", "Reuse KV blocks of shared prompt prefixes.",
       action=argparse.BooleanOptionalAction, default=None),
    _f("--enable-chunked-prefill", "Split long prefills across steps.", action=argparse.BooleanOptionalAction,
       default=None),
    _f("--max-num-seqs", "Requests an AR stage runs in one batch.", type=int, default=None),
    _f("--max-num-batched-tokens", "Token budget of one engine step.", type=int, default=None),
    _f("--max-model-len", "Longest prompt + output, in tokens.", type=int, default=None),
    _f("--dtype", "Model dtype (auto, float32, bfloat16, float16).", default=None),
    _f("--block-size", "Tokens per KV cache block.", type=int, default=None),
    _f("--tensor-parallel-size -tp", "Devices per stage for tensor parallelism.", type=int, default=None),
    _f("--seed", "Random seed of the engines.", type=int, default=None),
    _f("--load-format", "How weights are loaded: auto (from the checkpoint) or dummy (random, for benchmarks).",
       choices=("auto", "dummy"), default=None),
    _f("--max-tokens-limit", "The most max_tokens a client may ask of any stage (more is a 400). Unset: no cap, "
       "the context (max_model_len) bounds it; per stage: max_tokens_limit in the config or --stage-overrides.",
       type=int, default=None),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="checkpoint directory or hub id; omitted: the embedded tiny demo omni model")
    for title, flags in (("OmniConfig (spec 001)", OMNI_FLAGS), ("server", SERVER_FLAGS),
                         ("engine (applied to every stage)", ENGINE_FLAGS)):
        group = parser.add_argument_group(title)
        for flag in flags:
            help_text = flag.help if flag.refused is None else f"{flag.help} [Not supported yet: {flag.refused}; " \
                                                               "any other value than the default is refused.]"
            group.add_argument(*flag.names, dest=flag.dest, help=help_text, **flag.kwargs)
    input_limits.add_arguments(parser)
    realtime_limits.add_arguments(parser)
    stage_cli.add_arguments(parser)
    video_store.add_arguments(parser)
    tts_limits.add_arguments(parser)


# Flags that also take vLLM-style dotted sub-keys (--diffusion-attention-config.per_role.self.backend X).
DOTTED_FLAGS = ("--diffusion-attention-config", "-dac")


def fold_dotted_flags(argv: list[str]) -> list[str]:
    """`--diffusion-attention-config.a.b VALUE` (or `=VALUE`) folded into the flag's JSON object
    (a VALUE that parses as JSON is that value, else a string), merged over a JSON one given too."""
    out: list[str] = []
    dotted: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        flag = next((f for f in DOTTED_FLAGS if token.startswith(f + ".")), None)
        if flag is None:
            out.append(token)
            i += 1
            continue
        path, eq, value = token[len(flag) + 1:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise SystemExit(f"error: {token} needs a value")
            value, i = argv[i + 1], i + 1
        i += 1
        keys = path.split(".")
        node = dotted
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict) or not key:
                raise SystemExit(f"error: {token}: {path!r} is not a path of keys")
        node[keys[-1]] = _json_or_text(value)
    if not dotted:
        return out
    given = next((j for j, t in enumerate(out[:-1]) if t in DOTTED_FLAGS), None)
    if given is None:
        return [*out, DOTTED_FLAGS[0], json.dumps(dotted)]
    out[given + 1] = json.dumps(_merged(_json_object(out[given + 1]), dotted))
    return out


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merged(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def refused_flags(args: argparse.Namespace) -> list[str]:
    """One message per refused flag the user set (to anything but its documented default)."""
    return [f"{flag.names[0]}={getattr(args, flag.dest)!r} is not supported: {flag.refused}"
            for flag in (*OMNI_FLAGS, *SERVER_FLAGS) if flag.refused is not None
            and getattr(args, flag.dest) != flag.default]


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user gave (forwarded to every stage), diffusion flags included."""
    given = {f.dest: getattr(args, f.dest) for f in ENGINE_FLAGS if getattr(args, f.dest) is not None}
    if args.omni_dp_size_local != 1:
        given["num_replicas"] = args.omni_dp_size_local
    for flag in OMNI_FLAGS:
        if flag.dest in STAGE_SETTING_FLAGS and getattr(args, flag.dest) != flag.default:
            given[flag.dest] = getattr(args, flag.dest)
    return given


# Flags of spec 001 that are settings of the stages (config.STAGE_CLI_FIELDS): the diffusion
# flags for the diffusion stages, the AR ones for the AR stages, sleep mode for every stage.
STAGE_SETTING_FLAGS = (*DIFFUSION_FIELDS, *AR_FIELDS, "enable_sleep_mode")


def stage_overrides(args: argparse.Namespace) -> str | dict[str, Any] | None:
    """--stage-overrides, with --default-sampling-params folded in underneath it (it wins per field).
    Malformed values are passed on as they are: the config layer reports them with their source."""
    if args.default_sampling_params is None:
        return args.stage_overrides
    try:
        overrides = json.loads(args.stage_overrides) if args.stage_overrides else {}
    except json.JSONDecodeError:
        return args.stage_overrides
    if not isinstance(overrides, dict):
        return args.stage_overrides
    merged = {str(k): v for k, v in overrides.items()}
    for stage_id, defaults in args.default_sampling_params.items():
        entry = merged.setdefault(str(stage_id), {})
        if not isinstance(entry, dict):
            continue
        given = entry.get("default_sampling_params")
        if given is None:
            entry["default_sampling_params"] = defaults
        elif isinstance(given, dict) and isinstance(defaults, dict):
            entry["default_sampling_params"] = {**defaults, **given}
    return merged
