"""Race FAVOR+ against exact attention (torch SDPA) and performer-pytorch on the same inputs.

    python benchmarks/attention.py                       # B=1, H=12, D=64, m=256, L = 512 .. 32768
    python benchmarks/attention.py --lengths 512 1024 --out /tmp/bench   # a quick run

Prints one table (median times, ours/SDPA and ours/performer-pytorch ratios, achieved GFLOP/s against this machine's
measured matmul rate, peak memory above the inputs) and writes results.json, a markdown table and a PNG plot to
--out. Configurations that would need more than --memory-budget-gb are skipped and listed as such. Not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from performer_hf.favor import draw_projection, favor_attention

B, H, D = 1, 12, 64


def matmul_gflops(device: str) -> float:
    n = 2048 if device == "cpu" else 8192
    a = torch.randn(n, n, device=device)
    times = [_timed(lambda: a @ a, device) for _ in range(15)]
    return 2 * n**3 / statistics.median(times) / 1e9


def _sync(device):
    if device != "cpu":
        torch.cuda.synchronize()


def _timed(fn, device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


class PeakMemory:
    """Peak memory of one call above what was in use before it: CUDA allocator stats, or Linux VmHWM for CPU."""

    def __init__(self, device):
        self.device = device
        self.libc = ctypes.CDLL("libc.so.6") if device == "cpu" and sys.platform == "linux" else None

    @staticmethod
    def _status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    def measure(self, fn) -> float | None:
        if self.device != "cpu":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before
        if self.libc is None:
            return None
        self.libc.malloc_trim(0)  # hand freed heap back, so reuse shows up as growth
        before = self._status("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        fn()
        return self._status("VmHWM:") - before


def favor_flops(length, m, causal, chunk=64):
    features = 2 * 2 * length * D * m  # q and k projections
    sums = 2 * 2 * length * m * (D + 1)  # phi(K)^T [V, 1] and phi(Q) (...)
    intra = 2 * length * chunk * (m + D + 1) if causal else 0
    return B * H * (features + sums + intra)


def exact_flops(length, causal):
    return B * H * 4 * length * length * D * (0.5 if causal else 1.0)


def estimated_bytes(impl, length, causal, backward, m):
    """Rough peak memory, to skip what cannot fit rather than be killed mid-run."""
    act = B * H * length * 4
    if impl == "sdpa":
        return act * D * 8  # flash-style CPU and GPU kernels: O(L) memory
    if impl == "favor":
        return act * (m * (4 if backward else 1) + D * 8)
    # performer-pytorch: full (L, m) feature tensors; causal keeps per-token (m, D) contexts for each chunk and,
    # with autograd, for all of them
    causal_ctx = act * m * D * 2 if causal and backward else (act * m * D * 2 / 128 if causal else 0)
    return act * m * 6 + causal_ctx


def make_impls(m, device, causal):
    projection = draw_projection(m, D, generator=torch.Generator(device=device).manual_seed(0), device=device)
    impls = {
        "favor": lambda q, k, v: favor_attention(q, k, v, projection=projection, causal=causal),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    try:
        from performer_pytorch import FastAttention
    except ImportError:
        print("performer-pytorch is not installed (pip install -e '.[bench]'): skipping it", file=sys.stderr)
    else:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):  # it prints a notice about its CUDA kernel
            fast = FastAttention(dim_heads=D, nb_features=m, causal=causal).to(device)
        impls["performer-pytorch"] = fast
    return impls


def run_one(fn, length, backward, device, peak):
    g = torch.Generator(device=device).manual_seed(length)
    q, k, v = (torch.randn(B, H, length, D, generator=g, device=device, requires_grad=backward) for _ in range(3))

    def call():
        out = fn(q, k, v)
        if backward:
            out.sum().backward()
            for t in (q, k, v):
                t.grad = None

    first = _timed(call, device)  # warm-up, and a guide to how many repeats we can afford
    repeats = 5 if first < 1 else 3 if first < 10 else 1
    times = [_timed(call, device) for _ in range(repeats)]
    memory = peak.measure(call)
    return statistics.median(times), repeats, memory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--num-features", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--memory-budget-gb", type=float, default=12.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / "attention")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    rate = matmul_gflops(args.device)
    print(f"device {args.device}, {torch.get_num_threads()} threads, measured fp32 matmul {rate:.0f} GFLOP/s "
          "(measured again at the end; the higher is used in the table)", flush=True)
    peak = PeakMemory(args.device)
    rows = []
    for causal in (False, True):
        impls = make_impls(args.num_features, args.device, causal)
        for backward in (False, True):
            for length in args.lengths:
                row = {"causal": causal, "backward": backward, "length": length}
                for name, fn in impls.items():
                    need = estimated_bytes(name, length, causal, backward, args.num_features)
                    if need > args.memory_budget_gb * 2**30:
                        row[name] = {"skipped": f"needs about {need / 2**30:.0f} GiB > budget"}
                        continue
                    seconds, repeats, memory = run_one(fn, length, backward, args.device, peak)
                    row[name] = {"seconds": seconds, "repeats": repeats, "peak_bytes": memory}
                flops = favor_flops(length, args.num_features, causal) * (3 if backward else 1)
                if "seconds" in row["favor"]:
                    row["favor"]["gflops"] = flops / row["favor"]["seconds"] / 1e9
                if "seconds" in row["sdpa"]:
                    row["sdpa"]["gflops"] = exact_flops(length, causal) * (3 if backward else 1) / 1e9 / (
                        row["sdpa"]["seconds"])
                rows.append(row)
                print(format_row(row, rate), flush=True)

    rate = max(rate, matmul_gflops(args.device))  # the machine's peak: a busy moment only lowers a reading
    print(f"fp32 matmul peak used for the table: {rate:.0f} GFLOP/s")
    (args.out / "results.json").write_text(json.dumps({"device": args.device, "matmul_gflops": rate,
                                                       "threads": torch.get_num_threads(), "rows": rows}, indent=1))
    table = markdown_table(rows, rate)
    (args.out / "table.md").write_text(table)
    print("\n" + table)
    plot(rows, args.out / "attention.png", args.device)
    print(f"wrote {args.out}/results.json, table.md, attention.png")
    return 0


def _fmt_time(cell):
    if "skipped" in cell:
        return "skipped"
    return f"{cell['seconds'] * 1e3:.1f}"


def _ratio(row, other):
    if "seconds" in row["favor"] and "seconds" in row.get(other, {}):
        return f"{row['favor']['seconds'] / row[other]['seconds']:.3f}"
    return "-"


def _mem(cell):
    b = cell.get("peak_bytes")
    return "-" if b is None else f"{b / 2**20:.0f}"


HEADER = ("| mode | L | FAVOR+ ms | SDPA ms | performer-pytorch ms | ours/SDPA | ours/p-p | FAVOR+ GFLOP/s "
          "(% matmul) | peak MiB ours / SDPA / p-p |")


def markdown_table(rows, rate):
    lines = [HEADER, "|" + "---|" * 9]
    for row in rows:
        lines.append(format_row(row, rate))
    return "\n".join(lines) + "\n"


def format_row(row, rate):
    mode = ("causal" if row["causal"] else "bidir") + (" fwd+bwd" if row["backward"] else " fwd")
    pp = row.get("performer-pytorch", {"skipped": "not installed"})
    fav = row["favor"]
    gf = f"{fav['gflops']:.0f} ({100 * fav['gflops'] / rate:.0f}%)" if "gflops" in fav else "-"
    mems = " / ".join(_mem(c) for c in (fav, row["sdpa"], pp))
    return (f"| {mode} | {row['length']} | {_fmt_time(fav)} | {_fmt_time(row['sdpa'])} | {_fmt_time(pp)} | "
            f"{_ratio(row, 'sdpa')} | {_ratio(row, 'performer-pytorch')} | {gf} | {mems} |")


def plot(rows, path, device):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    styles = {"favor": "o-", "sdpa": "s--", "performer-pytorch": "^:"}
    for ax, causal in zip(axes[:2], (False, True), strict=True):
        for backward in (False, True):
            sel = [r for r in rows if r["causal"] == causal and r["backward"] == backward]
            for name, style in styles.items():
                pts = [(r["length"], r[name]["seconds"]) for r in sel if "seconds" in r.get(name, {})]
                if pts:
                    label = f"{name} {'fwd+bwd' if backward else 'fwd'}"
                    ax.loglog(*zip(*pts, strict=True), style, label=label, alpha=1 if backward else 0.6,
                              base=2)
        ax.set(title=f"{'causal' if causal else 'bidirectional'} (B=1, H=12, D=64, m=256, {device})",
               xlabel="sequence length", ylabel="seconds (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    for name, style in styles.items():
        for causal in (False, True):
            sel = [r for r in rows if r["causal"] == causal and not r["backward"]]
            pts = [(r["length"], r[name]["peak_bytes"] / 2**20) for r in sel
                   if r.get(name, {}).get("peak_bytes") is not None]
            if pts:
                ax.loglog(*zip(*pts, strict=True), style, label=f"{name} {'causal' if causal else 'bidir'}", base=2)
    ax.set(title="peak memory above inputs, forward", xlabel="sequence length", ylabel="MiB")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
