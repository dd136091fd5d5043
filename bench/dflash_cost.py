"""Draft cost per drafted token: one DFlash block forward against an EAGLE-3 chain of k head steps.

Prints, for each drafter and k, the median milliseconds of ``propose(k)`` (interleaved repetitions, fixed torch
threads, a C-token context), the cost per drafted token, its ratio to EAGLE-3's at the same k, and the weight bytes
one drafting step reads (at these batch-1 sizes a step is bound by reading its weights: small-M GEMMs). The
exported drafters are measured as served; ``--layers`` adds untrained DFlash drafters of other depths (cost does
not depend on the weights' values), of the trained one's geometry, or without ``--dflash`` of the reference recipe's
(block 8, target layers 1, 3, 6). On a GPU (``--device cuda``) each ``propose`` is timed between two
``torch.cuda.synchronize()`` calls, so a figure is the whole step, kernels and launches. Unless ``--onednn off``,
every RMSNorm runs as the engine serves it (``core.rms_norm.fuse_rms_norms``: torch's fused kernel wherever it gives
the same bits on this device), target and drafters alike.

Run: python bench/dflash_cost.py --dflash runs/reference-dflash/head --eagle3 runs/reference-eagle3/head \\
         [--threads 1] [--context 256] [--k 3 5 7] [--layers 1 2] [--onednn off|target|all] [--device cuda]
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from draftsmith.arguments import ArgumentParser, run_guarded
from draftsmith.core.onednn import pack_linears
from draftsmith.core.rms_norm import fuse_rms_norms
from draftsmith.core.target import TargetModel
from draftsmith.drafters.dflash.config import Section
from draftsmith.drafters.dflash.export import load_dflash
from draftsmith.drafters.dflash.proposer import DFlashProposer
from draftsmith.drafters.dflash.train import build_dflash
from draftsmith.drafters.eagle3.check import load_eagle3
from draftsmith.drafters.eagle3.proposer import Eagle3Proposer
from draftsmith.models import load_causal_lm


def step_bytes(modules, extra: torch.Tensor | None = None, times: int = 1) -> int:
    """Bytes of weight matrices one ``propose`` reads: those of ``modules`` ``times`` over (EAGLE-3: its decoder
    layer and lm_head once per chain step; the fc runs at accept), plus ``extra`` (DFlash: the target's lm_head)."""
    own = sum(p.numel() * p.element_size() for m in modules for p in m.parameters() if p.dim() == 2)
    return times * own + (0 if extra is None else extra.numel() * extra.element_size())


@torch.inference_mode()
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="reference")
    p.add_argument("--dflash", help="exported DFlash drafter directory (absent: the untrained --layers only)")
    p.add_argument("--eagle3", required=True, help="exported EAGLE-3 head directory")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--k", type=int, nargs="+", default=[3, 5, 7])
    p.add_argument("--layers", type=int, nargs="*", default=[1], help="untrained DFlash depths to add")
    p.add_argument("--block-size", type=int, default=8, help="the untrained drafters' block without --dflash")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 3, 6], help="the same, DFlash convention")
    p.add_argument("--device", default="cpu", help="cpu or cuda (oneDNN packing applies on cpu only)")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument(
        "--onednn",
        choices=["off", "target", "all"],
        default="target",
        help="pack linears for oneDNN (core/onednn.py): the target's, as the engine serves it (DFlash reads its "
        "lm_head), all (the drafters' too), or off (MKL everywhere)",
    )
    a = p.parse_args(argv)
    if not a.dflash and not a.layers:
        p.error("nothing to compare: give --dflash DIR or --layers N ...")
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    model, tok = load_causal_lm(a.target, dtype="float32")
    model.to(device)
    lm_head = model.get_output_embeddings().weight
    ctx = torch.randint(3, model.config.vocab_size, (a.context,), generator=torch.Generator().manual_seed(0))
    ctx = ctx.to(device)

    e3, _ = load_eagle3(a.eagle3, model, tok)
    e3 = e3.float().to(device)
    e3.bind_embedding(model.get_input_embeddings())
    drafters = {"eagle3": e3}
    block_size, layer_ids = a.block_size, list(a.target_layer_ids)
    if a.dflash:
        trained, _ = load_dflash(a.dflash, model, tok)
        drafters[f"dflash ({trained.config.num_hidden_layers} layers, trained)"] = trained.float().to(device)
        block_size, layer_ids = trained.config.block_size, list(trained.config.target_layer_ids)
    for n in a.layers:
        torch.manual_seed(0)
        section = Section(
            block_size=block_size, num_speculative_tokens=1, num_hidden_layers=n, target_layer_ids=layer_ids
        )
        drafters[f"dflash ({n} layers, untrained)"] = build_dflash(model, section, tok).eval().to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if a.onednn != "off":
        pack_linears(model)
    if a.onednn == "all":
        for head in drafters.values():
            pack_linears(head)
    # the engine's other serving kernel (serve/engine.py): fused RMSNorms where they give the same bits
    fused = 0 if a.onednn == "off" else sum(fuse_rms_norms(m) for m in (model, *drafters.values()))
    proposers = {}
    for name, head in drafters.items():
        if name == "eagle3":
            target = TargetModel(model, aux_layer_ids=head.config.aux_layer_ids)
            prop = Eagle3Proposer(head)
        else:
            head.bind_target(model.get_input_embeddings(), model.get_output_embeddings())
            target = TargetModel(model, aux_layer_ids=head.config.aux_layer_ids)
            prop = DFlashProposer(head)
        prop.start(ctx, 5, target.forward(ctx, target.new_cache()))
        proposers[name] = prop
    if max(a.k) > block_size - 1:
        raise SystemExit(f"--k {max(a.k)} > the DFlash block's {block_size - 1}")
    for prop in proposers.values():  # warm-up: CUDA's first calls (kernel selection, allocator) stay out
        prop.propose(max(a.k))
    sync()
    times = {(name, k): [] for name in proposers for k in a.k}
    for _ in range(a.repeats):  # interleaved: a noisy neighbour hits every row alike
        for (name, k), out in times.items():
            sync()
            t0 = time.perf_counter()
            proposers[name].propose(k)
            sync()
            out.append(time.perf_counter() - t0)
    cpu = platform.processor() or platform.machine()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, device {where}, {a.threads} thread(s), capability "
        f"{torch.backends.cpu.get_cpu_capability()}, {cpu}; context {a.context} tokens; median of {a.repeats}; "
        f"oneDNN linears: {a.onednn if device.type == 'cpu' else 'n/a'}; fused RMSNorms: {fused}"
    )
    print(f"{'drafter':34s} {'k':>2s} {'propose ms':>10s} {'ms/token':>9s} {'vs eagle3':>9s} {'MB read':>8s}")
    for k in a.k:
        e3_ms = statistics.median(times[("eagle3", k)]) * 1e3 / k
        for name, head in drafters.items():
            ms = statistics.median(times[(name, k)]) * 1e3
            if name == "eagle3":
                mb = step_bytes([head.midlayer, head.lm_head], times=k) / 2**20
            else:
                mb = step_bytes([head.layers], lm_head) / 2**20
            print(f"{name:34s} {k:2d} {ms:10.2f} {ms / k:9.2f} {ms / k / e3_ms:8.2f}x {mb:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_guarded("python bench/dflash_cost.py", main))
