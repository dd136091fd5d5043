"""The vLLM side of the referee (``referee.py``): run by the vLLM venv's python, ``python -I vllm_worker.py JOB``.

It imports the standard library and vLLM only (draftsmith is not installed in that venv). One ``LLM``, greedy,
prompts one at a time as token ids; the spec-decode counters are read from ``LLM.get_metrics()`` before and
after each prompt. The job and result files are JSON (``referee.vllm_job``, ``referee.run_vllm``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(job_path: str) -> None:
    """Runs in the vLLM venv: one ``LLM``, greedy, prompts one at a time, counters from its metrics."""
    job = json.loads(Path(job_path).read_text())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, spec = job["target"], job.get("spec")
    if spec is not None:  # a whole speculative config (e.g. ngram: no draft directory)
        pass
    elif job["draft"] and model:
        spec = {"method": job["method"], "model": job["draft"], "num_speculative_tokens": job["k"]}
    elif job["draft"]:  # `vllm serve HEAD/speculators`: the config names the target
        model, spec = job["draft"], {"num_speculative_tokens": job["k"]}
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        tokenizer=job["target"],
        speculative_config=spec,
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_seqs=1,
        seed=0,
        enforce_eager=job["enforce_eager"],
        generation_config="vllm",
        disable_log_stats=False,
    )
    startup = time.perf_counter() - t0

    def counters() -> dict:
        c = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
        for m in llm.get_metrics():
            name = m.name.removeprefix("vllm:spec_decode_")
            if name == "num_accepted_tokens_per_pos":
                c["accepted_per_pos"] = [int(v) for v in m.values]
            elif name in c:
                c[name] += int(m.value)
        return c

    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], stop_token_ids=job["stop_token_ids"], detokenize=False
    )
    passes = []  # seconds of each pass over the prompts (job["repeats"] passes; outputs of the last)
    for _ in range(int(job.get("repeats", 1))):
        outputs, per_prompt = [], []
        t0 = time.perf_counter()
        for ids in job["prompts"]:
            before = counters()
            [res] = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            after = counters()
            out = res.outputs[0]
            outputs.append({"tokens": list(out.token_ids), "finish_reason": out.finish_reason})
            per_prompt.append({"before": before, "after": after})
        passes.append(time.perf_counter() - t0)
    result = {
        "vllm_version": vllm.__version__,
        "startup_s": startup,
        "decode_s": passes[0],
        "passes_s": passes,
        "outputs": outputs,
        "counters": per_prompt,
        "speculative_config": spec,
        "served_model": llm.llm_engine.model_config.model,
    }
    Path(job["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
