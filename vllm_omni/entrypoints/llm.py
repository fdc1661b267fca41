"""`LLM`: offline batched generation on our engine, with vLLM's call shapes."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Union

from tqdm import tqdm

from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.output_accumulator import OutputAccumulator
from vllm_omni.outputs import RequestOutput
from vllm_omni.sampling_params import SamplingParams

PromptType = Union[str, dict[str, Any]]
ChatMessages = list[dict[str, Any]]


class LLM:
    """Offline inference.

    >>> llm = LLM("path/to/checkpoint")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        # The engine's outputs are deltas; each request's (one, final) output folds into a whole.
        accumulators: dict[str, OutputAccumulator] = {}
        for prompt, params in zip(prompts, params_list):
            request_id = str(next(self._ids))
            text, token_ids = self._tokenize(prompt)
            accumulators[request_id] = OutputAccumulator(request_id, text, token_ids)
            early = self.engine.add_request(request_id, token_ids, params, prompt=text)
            if early is not None:
                accumulators[request_id].add(early)
        self._run(accumulators, use_tqdm)
        return [acc.output for acc in accumulators.values()]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self._require_tokenizer()
        prompts = [
            tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    # --- helpers ----------------------------------------------------------------
    @staticmethod
    def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} sampling params for {num_prompts} prompts")
        return list(sampling_params)

    def _require_tokenizer(self):
        if self.engine.tokenizer is None:
            raise ValueError("this LLM was created with skip_tokenizer_init=True: pass prompt_token_ids")
        return self.engine.tokenizer

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            # Chat templates already contain their special tokens; Qwen tokenizers add none.
            return prompt, self._require_tokenizer().encode(prompt, add_special_tokens=False)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}")

    def _run(self, accumulators: dict[str, OutputAccumulator], use_tqdm: bool) -> None:
        bar = tqdm(total=len(accumulators), desc="Processed prompts", disable=not use_tqdm)
        bar.update(sum(acc.output.finished for acc in accumulators.values()))
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    accumulators[output.request_id].add(output)
                    bar.update(output.finished)
        finally:
            bar.close()
