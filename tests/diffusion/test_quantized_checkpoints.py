"""Transformers stored quantized: a ModelOpt FP8 diffusers folder (loads as FP8, other formats are
refused by name) and a GGUF file (`{"method": "gguf", "gguf_model": PATH}`)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from tests.diffusion.conftest import Case, image_of, run_engine
from tests.diffusion.test_tea_cache import psnr
from vllm_omni.model_executor.layers.fp8_linear import Fp8Linear, quantize_rows
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
from vllm_omni.model_executor.models.diffusion_quantization_spec import DiffusionQuantization

CPU = torch.device("cpu")


def _modelopt_folder(src, dst, algo):
    """The tiny Qwen-Image with its transformer's block linears stored as ModelOpt does: float8
    weights, float32 weight_scale ([out, 1] per channel, or a scalar per tensor), input_scale (FP8)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = dst / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    for key in [k for k in state if k.startswith("transformer_blocks.") and k.endswith(".weight") and state[k].dim() == 2]:
        w = state[key]
        if algo == "FP8":
            scale = w.abs().amax() / 448
            state[key], state[key + "_scale"] = (w / scale).to(torch.float8_e4m3fn), scale.reshape(())
            state[key[:-len("weight")] + "input_scale"] = torch.tensor(0.05)
        else:
            state[key], scale = quantize_rows(w)
            state[key + "_scale"] = scale
    save_file(state, weights)
    config = json.loads((dst / "transformer" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo}
    (dst / "transformer" / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("algo", ["FP8_PER_CHANNEL_PER_TOKEN", "FP8"])
def test_a_modelopt_fp8_folder_loads_its_fp8_layers(qwen_image_dir, t2i_model, tmp_path, algo):
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    model = QwenImageModel.load(_modelopt_folder(qwen_image_dir, tmp_path / "qi", algo), device=CPU,
                                dtype=torch.float32)
    ours, original = model.c.transformer, t2i_model.c.transformer
    layer, reference = ours.transformer_blocks[1].attn.to_q, original.transformer_blocks[1].attn.to_q
    assert isinstance(layer, Fp8Linear) and model.describe()["fp8_layers"] > 0
    assert (layer.input_scale is not None) == (algo == "FP8")
    torch.testing.assert_close(layer.dequantized_weight(), reference.weight, rtol=2 ** -4, atol=1e-6)
    torch.testing.assert_close(layer.bias, reference.bias)
    torch.testing.assert_close(ours.img_in.weight, original.img_in.weight)  # the rest loads as it is
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":  # the same numbers as online FP8 of the same weights
        online = Fp8Linear.from_linear(reference)
        assert torch.equal(layer.weight.float(), online.weight.float()) and torch.equal(layer.weight_scale,
                                                                                      online.weight_scale)


def test_other_quantized_formats_are_refused_by_name(tmp_path):
    from vllm_omni.model_executor.models.diffusers_folder import refuse_quantized

    for quant, match in (({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt NVFP4\\) is not supported"),
                         ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8_PB_WO"}},
                          "modelopt FP8_PB_WO\\) is not supported"),
                         ({"quant_method": "awq"}, "awq\\) is not supported"),
                         ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
                          "calibrated attention scales")):
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
        with pytest.raises(ValueError, match=match):
            refuse_quantized(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}}}))
    assert refuse_quantized(tmp_path) == "FP8_PER_CHANNEL_PER_TOKEN"


def _write_gguf(transformer: nn.Module, path) -> int:
    """The transformer's tensors in a GGUF file: Q8_0 where a row holds whole 32-value blocks,
    float32 elsewhere; the number of Q8_0 tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen_image")
    quantized = 0
    for name, tensor in transformer.state_dict().items():
        data = tensor.float().numpy()
        if data.ndim == 2 and data.shape[1] % 32 == 0:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            quantized += 1
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized


def test_a_gguf_transformer_generates_close_to_the_original(qwen_image_dir, t2i_model, make_engine, tmp_path):
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    path = tmp_path / "transformer.gguf"
    assert _write_gguf(t2i_model.c.transformer, path) >= 4
    model = QwenImageModel.load(qwen_image_dir, device=CPU, dtype=torch.float32, acceleration=DenoiserAcceleration(
        quantization=DiffusionQuantization("gguf", gguf_model=str(path))))
    ff = model.c.transformer.transformer_blocks[0].img_mlp.net[2]
    assert type(ff).__name__ == "GGUFLinear" and type(ff.weight).__name__ == "GGUFParameter"  # stays quantized
    case = Case("g", "a red fox", params=dict(height=64, width=64, num_inference_steps=4, seed=7))
    gguf_image = image_of(run_engine(make_engine(model), [case])["g"])
    exact = image_of(run_engine(make_engine(), [case])["g"])
    assert not torch.equal(gguf_image, exact) and psnr(gguf_image, exact) >= 35.0
    with pytest.raises(ValueError, match="is not a file"):
        QwenImageModel.load(qwen_image_dir, device=CPU, dtype=torch.float32, acceleration=DenoiserAcceleration(
            quantization=DiffusionQuantization("gguf", gguf_model=str(tmp_path / "none.gguf"))))
