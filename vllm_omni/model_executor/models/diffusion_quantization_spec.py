"""What `--diffusion-quantization-config` says, parsed and checked at the config edge without torch (config/ reads it);
diffusion_quantization.py applies it (its docstring has the methods)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("fp8", "gguf")
_KEYS = {"fp8": {"method", "activation_scheme", "ignored_layers"}, "gguf": {"method", "gguf_model"}}
# Methods upstream knows, and why they are not here.
_REFUSED = {
    "int8": "int8 W8A8 kernels are not implemented",
    "mxfp8": "MXFP8 needs Blackwell or Ascend kernels that are not implemented",
    "mxfp4": "MXFP4 needs Blackwell or Ascend kernels that are not implemented",
    "nvfp4": "NVFP4 needs Blackwell kernels that are not implemented",
    "modelopt": "a ModelOpt checkpoint carries its own quantization_config (FP8 ones load without this flag)",
    "autoround": "AutoRound checkpoints are not supported",
    "bitsandbytes": "bitsandbytes is not a dependency",
}


@dataclass(frozen=True)
class DiffusionQuantization:
    method: str  # "fp8" | "gguf"
    ignored_layers: tuple[str, ...] = ()  # fp8: block layers kept in the model dtype (substrings of their names)
    gguf_model: str | None = None  # gguf: the file

    @classmethod
    def parse(cls, value: Any) -> DiffusionQuantization | None:
        """The flag's JSON object (None: no quantization); ValueError names what is wrong."""
        if value is None:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("method"), str):
            raise ValueError('a JSON object with a "method": {"method": "fp8"} or {"method": "gguf", "gguf_model": PATH}')
        method = value["method"].lower()
        if method not in METHODS:
            reason = _REFUSED.get(method, "unknown method")
            raise ValueError(f"quantization method {value['method']!r} is not supported ({reason}); "
                             f"supported: {' | '.join(METHODS)}")
        unknown = sorted(set(value) - _KEYS[method])
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} for method {method!r}; allowed: {sorted(_KEYS[method])}")
        if method == "gguf":
            path = value.get("gguf_model")
            if not isinstance(path, str) or not path.strip():
                raise ValueError('method "gguf" needs "gguf_model": the path of the transformer\'s .gguf file')
            return cls("gguf", gguf_model=path)
        if value.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"activation_scheme {value['activation_scheme']!r} is not supported: online FP8 "
                             "quantizes activations per token (\"dynamic\"); static scales need a calibrated checkpoint")
        ignored = value.get("ignored_layers", [])
        if not isinstance(ignored, list) or not all(isinstance(s, str) and s for s in ignored):
            raise ValueError("ignored_layers must be a list of non-empty layer-name strings")
        return cls("fp8", ignored_layers=tuple(ignored))

    def to_json(self) -> dict[str, Any]:
        if self.method == "gguf":
            return {"method": "gguf", "gguf_model": self.gguf_model}
        return {"method": "fp8", **({"ignored_layers": list(self.ignored_layers)} if self.ignored_layers else {})}
