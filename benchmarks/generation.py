"""Per-token generation latency and cache memory: a converted model (recurrent FAVOR state) against the original
softmax model (KV cache), after prompts of 512 to 16k tokens.

    python benchmarks/generation.py                      # Llama-shaped model from config, L = 512 .. 16384
    python benchmarks/generation.py --lengths 512 1024 --out /tmp/gen

The model is built from config (4 layers, hidden 512, 8 heads of 64, rotary, no download). For each context length
it prefills the prompt once, then times single-token decode steps and reports the median, plus the cache's bytes.
Writes results.json, table.md and generation.png to --out. Not a test.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import performer_hf
from performer_hf.generation import PerformerCache


def build(layers: int, hidden: int, heads: int, max_len: int, kv_heads: int | None = None):
    config = LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                         max_position_embeddings=max_len)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def cache_bytes(cache) -> int:
    if isinstance(cache, PerformerCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


@torch.no_grad()
def measure(model, cache, length: int, steps: int) -> tuple[float, int]:
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, model.config.vocab_size, (1, length), generator=g)
    logits = model(prompt, past_key_values=cache, use_cache=True).logits
    token = logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(token, past_key_values=cache, use_cache=True).logits
        times.append(time.perf_counter() - start)
        token = logits[:, -1:].argmax(-1)
    return statistics.median(times), cache_bytes(cache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per length (median reported)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention (default: --heads); "
                        "SmolLM2-135M: --layers 30 --hidden 576 --heads 9 --kv-heads 3")
    parser.add_argument("--num-features", type=int, default=256)
    # pure FAVOR by default, as in the README's table; --sink-tokens 4 --local-window 128 for the conversion default
    # (its state adds the window's W - 1 keys and values per layer, still constant in the context)
    parser.add_argument("--sink-tokens", type=int, default=0)
    parser.add_argument("--local-window", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / "generation_cpu")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    max_len = max(args.lengths) + args.steps + 1
    softmax = build(args.layers, args.hidden, args.heads, max_len, args.kv_heads)
    performer = performer_hf.convert(copy.deepcopy(softmax), num_features=args.num_features,
                                     sink_tokens=args.sink_tokens, local_window=args.local_window)
    print(f"Llama-shaped model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"({args.kv_heads or args.heads} key/value); FAVOR+ "
          f"m={args.num_features}; {torch.get_num_threads()} threads", flush=True)
    rows = []
    for length in args.lengths:
        s_time, s_bytes = measure(softmax, DynamicCache(), length, args.steps)
        p_time, p_bytes = measure(performer, PerformerCache(), length, args.steps)
        row = {"context": length, "softmax_ms": s_time * 1e3, "performer_ms": p_time * 1e3,
               "softmax_cache_mib": s_bytes / 2**20, "performer_cache_mib": p_bytes / 2**20}
        rows.append(row)
        print(format_row(row), flush=True)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": rows}, indent=1))
    table = "\n".join([HEADER, "|---|---|---|---|---|---|---|"] + [format_row(r) for r in rows]) + "\n"
    (args.out / "table.md").write_text(table)
    # the KV cache grows by the same bytes every token: where it passes the constant state
    first, last = rows[0], rows[-1]
    per_token = (last["softmax_cache_mib"] - first["softmax_cache_mib"]) / max(1, last["context"] - first["context"])
    if per_token > 0:
        state = last["performer_cache_mib"]
        table += (f"\nKV cache {per_token * 2**20 / 1024:.1f} KiB per token; the {state:.2f} MiB state is smaller "
                  f"beyond {state / per_token:.0f} tokens of context\n")
    print("\n" + table)
    plot(rows, args.out / "generation.png")
    print(f"wrote {args.out}/results.json, table.md, generation.png")
    return 0


HEADER = ("| context | softmax + KV cache, ms/token | Performer + state, ms/token | latency ratio | KV cache MiB | "
          "FAVOR state MiB | memory ratio |")


def format_row(r) -> str:
    return (f"| {r['context']} | {r['softmax_ms']:.2f} | {r['performer_ms']:.2f} | "
            f"{r['performer_ms'] / r['softmax_ms']:.2f} | {r['softmax_cache_mib']:.1f} | "
            f"{r['performer_cache_mib']:.2f} | {r['softmax_cache_mib'] / r['performer_cache_mib']:.0f}x |")


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    x = [r["context"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(x, [r["softmax_ms"] for r in rows], "s--", label="softmax + KV cache")
    a.plot(x, [r["performer_ms"] for r in rows], "o-", label="Performer + FAVOR state")
    a.set(xscale="log", xlabel="context (tokens)", ylabel="ms per generated token (median)", title="decode latency")
    b.plot(x, [r["softmax_cache_mib"] for r in rows], "s--", label="KV cache")
    b.plot(x, [r["performer_cache_mib"] for r in rows], "o-", label="FAVOR state")
    b.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="MiB", title="cache memory")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
