"""Dotted names (documented ones and user plugins), bundled-config lookup, one-stage LLMs."""
import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from vllm_omni.config import (DOCUMENTED_DOTTED_NAMES, ConfigError, ConfigFormat, find_bundled_config,
                              load_pipeline_config, pipeline_for_model, resolve_dotted,
                              single_stage_pipeline, validate_dotted_names)
from vllm_omni.config.bundled import DEPLOY_DIR, STAGE_CONFIGS_DIR


def test_parsing_imports_nothing_heavy(tmp_path):
    # Loading a config must not import the documented workers, schedulers, bridges or models
    # (they pull in the engine); those are imported when a stage starts or by check-config.
    # The family records (model_executor/models/<family>/__init__.py) are plain data and may be read.
    code = textwrap.dedent(f"""
        import sys
        from vllm_omni.config import load_pipeline_config
        from vllm_omni.model_executor.models.families import FAMILIES
        load_pipeline_config({str(STAGE_CONFIGS_DIR / 'qwen3_omni_moe.yaml')!r})
        records = {{'vllm_omni.model_executor.models', 'vllm_omni.model_executor.models.family',
                   'vllm_omni.model_executor.models.families',
                   'vllm_omni.model_executor.dtypes',  # dtype spellings: imports no torch
                   'vllm_omni.model_executor.models.diffusion_attention_spec',  # flag parsing, no torch
                   'vllm_omni.model_executor.models.diffusion_quantization_spec'}}
        # each family's package (the folder holding its record)
        records |= {{f.stage_models[s].split(':')[0].rsplit('.', 1)[0] for f in FAMILIES for s in f.stage_models}}
        heavy = [m for m in sys.modules if m.startswith(('vllm_omni.worker.', 'vllm_omni.model_executor.',
                 'vllm_omni.core.', 'vllm_omni.engine.')) and m not in records]
        print(heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(DOCUMENTED_DOTTED_NAMES))
def test_documented_dotted_names_resolve(name):
    module = name.rpartition(".")[0]
    try:
        present = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        present = False
    if not present:
        pytest.skip(f"{module} is not written yet")
    assert callable(resolve_dotted(name))


@pytest.fixture
def plugins(plugin_package):
    return plugin_package({
        "worker": "class MyWorker:\n    pass\nNOT_CALLABLE = 3\n",
        "bridge": "def encoder2decoder(stage_list, engine_input_source, prompt=None, mm=False):\n    return []\n",
        "model": "class MyModel:\n    pass\n",
    })


def _plugin_yaml(pkg: str, **change: str) -> str:
    names = {"worker_cls": f"{pkg}.worker.MyWorker",
             "model_arch": f"{pkg}.model.MyModel", "func": f"{pkg}.bridge.encoder2decoder", **change}
    return f"""\
        stage_args:
          - stage_id: 0
            engine_args: {{model_stage: encoder, model_arch: {names['model_arch']}}}
          - stage_id: 1
            engine_input_source: [0]
            custom_process_input_func: {names['func']}
            engine_args:
              model_arch: {names['model_arch']}
              worker_cls: {names['worker_cls']}
        """


def test_user_plugins_are_imported(plugins, write_yaml):
    p = load_pipeline_config(write_yaml(_plugin_yaml(plugins)))
    validate_dotted_names(p)
    s1 = p.stage(1)
    assert resolve_dotted(s1.engine_args.worker_cls).__name__ == "MyWorker"
    assert resolve_dotted(s1.custom_process_input_func)([], [0]) == []
    assert s1.engine_args.worker_type.value == "ar"


@pytest.mark.parametrize("change, expected", [
    ({"worker_cls": "{pkg}.worker.Missing"}, ["stage 1: engine_args.worker_cls=", "has no attribute 'Missing'",
                                              "allowed: MyWorker, NOT_CALLABLE"]),
    ({"func": "{pkg}.nowhere.fn"}, ["stage 1: custom_process_input_func=", "not found on sys.path"]),
    ({"worker_cls": "{pkg}.worker.NOT_CALLABLE"}, ["stage 1: engine_args.worker_cls=", "resolves to a int"]),
    ({"model_arch": "NoSuchArchForCausalLM"}, ["stage 0: engine_args.model_arch='NoSuchArchForCausalLM'"]),
])
def test_unresolvable_dotted_names(plugins, write_yaml, change, expected):
    change = {k: v.format(pkg=plugins) for k, v in change.items()}
    p = load_pipeline_config(write_yaml(_plugin_yaml(plugins, **change)))
    with pytest.raises(ConfigError) as info:
        validate_dotted_names(p)
    message = str(info.value)
    assert "stages.yaml: dotted names do not resolve" in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_plugin_import_error_is_reported(plugin_package, write_yaml):
    pkg = plugin_package({"broken": "raise RuntimeError('plugin exploded')\n"})
    p = load_pipeline_config(write_yaml(f"stage_args:\n  - stage_id: 0\n    engine_args: "
                                        f"{{worker_cls: {pkg}.broken.S}}\n"))
    with pytest.raises(ConfigError, match="RuntimeError: plugin exploded"):
        validate_dotted_names(p)


def test_a_scheduler_class_of_ones_own_is_refused_when_parsed(plugins, write_yaml):
    # The scheduler is part of the stage engine: a class named here would never run.
    with pytest.raises(ConfigError, match=r"stage 0: engine_args.scheduler_cls='[\w.]+MyWorker': scheduler_cls "
                                          r"'[\w.]+' is not supported: the scheduler is part of the stage engine"):
        load_pipeline_config(write_yaml(f"stage_args:\n  - stage_id: 0\n    engine_args: "
                                        f"{{scheduler_cls: {plugins}.worker.MyWorker}}\n"))


@pytest.mark.parametrize("hf, expected", [
    ({"model_type": "qwen2_5_omni", "architectures": ["Qwen2_5OmniModel"]}, "qwen2_5_omni"),
    ({"model_type": "something", "architectures": ["Qwen2_5OmniForConditionalGeneration"]}, "qwen2_5_omni"),
    ({"model_type": "qwen3_omni_moe", "architectures": []}, "qwen3_omni_moe"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, None),
])
def test_bundled_lookup(hf, expected, tmp_path):
    assert (pipeline_for_model(hf).name if expected else pipeline_for_model(hf)) == expected
    (tmp_path / "config.json").write_text(json.dumps(hf))
    legacy = find_bundled_config(tmp_path)
    assert legacy == (STAGE_CONFIGS_DIR / f"{expected}.yaml" if expected else None)
    if expected:
        assert find_bundled_config(hf, kind="deploy") == DEPLOY_DIR / f"{expected}.yaml"
        assert legacy.is_file() and find_bundled_config(hf, kind="deploy").is_file()


def test_hf_config_object_and_hub_cache(tmp_path, monkeypatch):
    class FakeConfig:
        model_type = "qwen3_omni_moe"
        architectures = ["Qwen3OmniMoeForConditionalGeneration"]

    assert pipeline_for_model(FakeConfig()).name == "qwen3_omni_moe"
    snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-Omni-7B" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert pipeline_for_model("Qwen/Qwen2.5-Omni-7B").name == "qwen2_5_omni"
    with pytest.raises(ConfigError, match="no config.json found"):
        pipeline_for_model("Qwen/Not-Downloaded")


def test_unknown_model_kind_is_an_error():
    with pytest.raises(ConfigError, match="no bundled stage config for model_type='bagel'"):
        pipeline_for_model({"model_type": "bagel", "architectures": ["BagelForConditionalGeneration"]})
    tts = pipeline_for_model({"model_type": "qwen3_tts", "architectures": ["Qwen3TTSForConditionalGeneration"]})
    assert tts.name == "qwen3_tts"


def test_plain_llm_is_one_stage(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2",
                                                      "architectures": ["Qwen2ForCausalLM"]}))
    p = load_pipeline_config(model=str(tmp_path))
    assert p == single_stage_pipeline(str(tmp_path))
    assert p.format is ConfigFormat.SINGLE_STAGE and p.num_stages == 1 and p.edges == ()
    s = p.stage(0)
    assert s.final_output and s.final_output_type.value == "text" and s.is_comprehension
    assert s.engine_args.engine_output_type.value == "text" and s.engine_args.model_arch == "Qwen2ForCausalLM"
    assert s.engine_args.worker_type.value == "ar"
    assert s.default_sampling_params.repetition_penalty == 1.0
    tuned = load_pipeline_config(model=str(tmp_path), stage_overrides='{"0": {"max_num_seqs": 4}}')
    assert tuned.stage(0).engine_args.max_num_seqs == 4


def test_model_arch_checked_against_the_registry(monkeypatch, write_yaml):
    import vllm_omni.config.resolve as resolve

    monkeypatch.setattr(resolve, "supported_architectures",
                        lambda: frozenset({"Qwen2ForCausalLM", "OmniX[thinker]"}))
    def config(arch, stage):
        return load_pipeline_config(write_yaml(
            f"stage_args:\n  - stage_id: 0\n    engine_args: {{model_arch: {arch}, model_stage: {stage},"
            f" worker_type: diffusion}}\n"))
    validate_dotted_names(config("OmniX", "thinker"))
    validate_dotted_names(config("Qwen2ForCausalLM", "anything"))
    with pytest.raises(ConfigError, match=r"model_arch='OmniX' \(model_stage='talker'\): not a registered "
                                          r"architecture; allowed: OmniX\[thinker\], Qwen2ForCausalLM"):
        validate_dotted_names(config("OmniX", "talker"))
