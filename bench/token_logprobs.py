"""Token log-probs forward + backward: art's `token_logprobs` vs TRL's `selective_log_softmax`.

The trainer's last op of every pass: `log_softmax(logits)[target]` over the whole vocabulary at
each trained position, and its gradient. Shapes of the training bench (`train_throughput.py`): a
CPU pass keeps up to ~600 trained positions, SmolLM2's vocabulary is 49,152, the logits are bf16
(`train_dtype=auto` on a CPU with bf16 units). TRL's helper is what the trainer used before: the
logits upcast to float32, then `selective_log_softmax`, the gradient through autograd. Both get the
same logits and upstream gradient; the script checks that they agree, then times them alternately
at each thread count and prints the ratio of the medians.

    .venv/bin/python bench/token_logprobs.py [--rows 576] [--vocab 49152] [--dtype bfloat16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from trl.trainer.utils import selective_log_softmax

from bench.options import positive_int
from trainer_service.logprobs import token_logprobs

Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def trl_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return selective_log_softmax(logits.float(), targets)


def forward_backward(fn: Fn, logits: torch.Tensor, targets: torch.Tensor,
                     grad: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Seconds for one forward and backward of `fn`, its values and the logits' gradient."""
    leaf = logits.detach().requires_grad_(True)
    started = time.perf_counter()
    values = fn(leaf, targets)
    (values * grad).sum().backward()
    elapsed = time.perf_counter() - started
    assert leaf.grad is not None
    return elapsed, values.detach(), leaf.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=positive_int, default=576, help="trained positions in one pass")
    parser.add_argument("--vocab", type=positive_int, default=49152, help="vocabulary size (49152: SmolLM2's)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the logits' dtype")
    parser.add_argument("--rounds", type=positive_int, default=7,
                        help="timed forward+backward runs per variant and thread count")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=gen) * 3).to(getattr(torch, args.dtype))
    targets = torch.randint(0, args.vocab, (args.rows,), generator=gen)
    grad = torch.randn(args.rows, generator=gen)
    variants: dict[str, Fn] = {"art token_logprobs": token_logprobs, "TRL selective_log_softmax": trl_logprobs}

    _, art_values, art_grad = forward_backward(token_logprobs, logits, targets, grad)
    _, trl_values, trl_grad = forward_backward(trl_logprobs, logits, targets, grad)
    value_gap = float((art_values - trl_values).abs().max())
    grad_gap = float((art_grad.float() - trl_grad.float()).abs().max())
    print(f"logits [{args.rows}, {args.vocab}] {args.dtype}; largest difference art - TRL: values {value_gap:.2e}, "
          f"gradient {grad_gap:.2e} (gradient largest {float(trl_grad.float().abs().max()):.2e})")
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(2):  # warm-up
            for fn in variants.values():
                forward_backward(fn, logits, targets, grad)
        for round_ in range(args.rounds):
            order = list(variants.items()) if round_ % 2 == 0 else list(variants.items())[::-1]
            for name, fn in order:
                times[name].append(forward_backward(fn, logits, targets, grad)[0])
        medians = {name: statistics.median(values) for name, values in times.items()}
        line = " | ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in medians.items())
        ratio = medians["TRL selective_log_softmax"] / medians["art token_logprobs"]
        print(f"{threads} thread{'s' if threads > 1 else ''}: {line} (medians of {args.rounds}) | ratio art / TRL "
              f"(speed): {ratio:.2f}x")


if __name__ == "__main__":
    main()
