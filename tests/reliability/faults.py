"""Fault injection for a real server: the Qwen2.5-Omni thinker2talker bridge, wrapped.

A request that asks for one of the FAULT_VOICES fails at that hop; every other request goes
through the real bridge unchanged. The voices are copies of "Chelsie" added to a copy of the
tiny checkpoint (`add_fault_voices`), so a fault is chosen by an ordinary request field:

- FaultBridge: the bridge itself raises.
- FaultEncode: the payload holds an integer msgpack cannot carry (the orchestrator's encode).
- FaultSend:   a tensor that cannot be copied out for the transport (frames / shared memory).
- FaultStep:   hidden states one column too wide: accepted by the talker's add_request, the
               batched talker step fails on them.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from vllm_omni.model_executor.models.bridge_utils import requested_speaker
from vllm_omni.model_executor.models.qwen2_5_omni import bridges

FAULT_VOICES = ("FaultBridge", "FaultEncode", "FaultSend", "FaultStep")
THINKER2TALKER = "tests.reliability.faults.thinker2talker"


def add_fault_voices(model_dir: Path, out_dir: Path) -> Path:
    """A copy of a tiny Qwen2.5-Omni checkpoint whose spk_dict also has the fault voices."""
    shutil.copytree(model_dir, out_dir)
    speakers = torch.load(out_dir / "spk_dict.pt")
    for name in FAULT_VOICES:
        speakers[name] = speakers["Chelsie"]
    torch.save(speakers, out_dir / "spk_dict.pt")
    return out_dir


def thinker2talker(stage_list: list[Any], engine_input_source: list[int], prompt: Any = None,
                   requires_multimodal_data: bool = False) -> list[Any]:
    inputs = bridges.thinker2talker(stage_list, engine_input_source, prompt, requires_multimodal_data)
    fault = requested_speaker(prompt)
    if fault not in FAULT_VOICES:
        return inputs
    if fault == "FaultBridge":
        raise RuntimeError("injected: the bridge failed")
    info = inputs[0]["additional_information"]
    if fault == "FaultEncode":
        info["injected"] = 2**70
    elif fault == "FaultSend":
        info["thinker_embeds"] = torch.empty(info["thinker_embeds"].shape, device="meta")
    else:
        for key in ("thinker_embeds", "thinker_hidden"):
            info[key] = torch.cat([info[key], info[key][:, :1]], dim=1)
    return inputs
