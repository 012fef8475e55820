"""Peak memory and time of the LM head's log-probs, forward + backward: full [tokens x vocab] vs chunked.

    uv run python benchmarks/bench_logprobs.py                          # 2048 tokens, Qwen3's vocab, hidden 1024
    uv run python benchmarks/bench_logprobs.py --tokens 4096 --chunk 512

`full` is what the trainer did before the chunked head: logits of the whole row, upcast to fp32, / T,
log-softmax, the target's log-prob, entropy from the same log-softmax (no grad). `chunked` is
`prime_rl.trainer.model.logprobs.chunked_logprobs`. On CPU each variant runs in a subprocess of its own and reports
its peak RSS (ru_maxrss) and the RSS held before the head ran (inputs, torch itself); on CUDA both run here
and report torch.cuda.max_memory_allocated above the inputs.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from prime_rl.trainer.model.logprobs import chunked_logprobs


def rss_gib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def full_logprobs(hidden, weight, targets, temperatures):
    logits = hidden @ weight.T
    logp_all = torch.log_softmax(logits.float() / temperatures[:, None], dim=-1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def run(variant: str, args, device: torch.device) -> dict:
    """Time `args.repeats` forward + backward passes of one variant; peak memory above what the inputs hold."""
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g, device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g, device=device, dtype=dtype) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g, device=device)
    temperatures = torch.full((args.tokens,), 0.7, device=device)
    upstream = torch.randn(args.tokens, generator=g, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        before = rss_gib()
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        if variant == "full":
            logp, _ = full_logprobs(hidden, weight, targets, temperatures)
        else:
            logp, _ = chunked_logprobs(hidden, weight, targets, temperatures, args.chunk)
        (upstream * logp).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        hidden.grad = weight.grad = None
        del logp
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else rss_gib()
    return {"variant": variant, "peak_gib": peak, "before_gib": before, "seconds": seconds}


def report(results: list[dict], args, device: torch.device) -> None:
    kind = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS (ru_maxrss), own process"
    print(
        f"{args.tokens} tokens x vocab {args.vocab}, hidden {args.hidden}, {args.dtype}, chunk {args.chunk}, "
        f"{device.type}{'' if device.type == 'cuda' else f' ({torch.get_num_threads()} threads)'}; memory: {kind}"
    )
    print(f"{'variant':>8} {'peak GiB':>9} {'held before GiB':>16} {'head GiB':>9} {'fwd+bwd s (median)':>19}")
    for r in results:
        print(
            f"{r['variant']:>8} {r['peak_gib']:>9.2f} {r['before_gib']:>16.2f} {r['peak_gib'] - r['before_gib']:>9.2f} "
            f"{statistics.median(r['seconds']):>19.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024, help="the trainer's default model.logprob_chunk")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA")
    parser.add_argument("--repeats", type=int, default=None, help="default: 2 on CPU, 5 on CUDA")
    parser.add_argument("--variant", choices=["full", "chunked"], help=argparse.SUPPRESS)  # a CPU child
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.repeats = args.repeats or (5 if device.type == "cuda" else 2)

    if args.variant is not None:
        print(json.dumps(run(args.variant, args, device)))
        return
    results = []
    for variant in ("full", "chunked"):
        if device.type == "cuda":
            results.append(run(variant, args, device))
            continue
        child = [sys.executable, __file__, "--variant", variant] + [
            f"--{k}={v}" for k, v in vars(args).items() if k != "variant"
        ]
        out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    report(results, args, device)


if __name__ == "__main__":
    main()
