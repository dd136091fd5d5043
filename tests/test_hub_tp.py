"""`draftsmith push --dry-run` and the tensor-parallel layout check (no network)."""

import pytest

from draftsmith.export.metadata import HeadMismatchError
from draftsmith.export.tensor_parallel import tensor_parallel_problems
from draftsmith.pipeline.hub import plan_push, push_head


@pytest.fixture
def head_dir(tiny_llama, tmp_path):
    from draftsmith.drafters.eagle3.export import export_eagle3
    from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
    from draftsmith.identity import target_identity

    target = tiny_llama(seed=9)
    head = Eagle3Head(Eagle3Config.from_target(target.config, aux_layer_ids=(1, 2, 3)))
    out = tmp_path / "head"
    export_eagle3(head, out, target_identity(target, None, "tiny"), target.config)
    return out


def test_push_dry_run_lists_files_and_sends_nothing(head_dir, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: pytest.fail("dry run must not reach the Hub"))
    plan = push_head(head_dir, "org/head", dry_run=True)
    names = [n for n, _ in plan.files]
    assert {"model.safetensors", "config.json", "draftsmith.json"} <= set(names)
    assert "org/head@main" in plan.summary()


def test_push_refuses_corrupted_head_and_bad_repo_id(head_dir):
    with pytest.raises(ValueError, match="ORG/NAME"):
        plan_push(head_dir, "no-slash")
    data = bytearray((head_dir / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (head_dir / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(HeadMismatchError, match="sha256"):
        plan_push(head_dir, "org/head")


def test_tensor_parallel_problems():
    cfg = {"num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 960}
    assert tensor_parallel_problems(cfg, 2) == []
    assert tensor_parallel_problems(cfg, 6) == []  # 2 KV heads replicated over 6 ranks
    problems = tensor_parallel_problems(cfg, 4)
    assert len(problems) == 1 and "num_attention_heads 6" in problems[0]
    assert len(tensor_parallel_problems(cfg, 7)) == 3  # heads, KV heads and intermediate size
    assert (
        len(tensor_parallel_problems({"num_attention_heads": 8, "num_key_value_heads": 3, "intermediate_size": 12}, 2))
        == 1
    )
