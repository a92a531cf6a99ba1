"""What structured outputs' masks cost on the host at a large vocabulary (sample/structured_outputs.py):
llguidance's masks for R requests at 1 position (a plain step) or k + 1 positions (a verification
block, drafts consumed and rolled back), and the unpacking of the bits into a [rows, V] bool mask.

    python3 benchmarks/structured_mask_bench.py [--vocab 151936] [--requests 1,64,256] [--positions 1,8]
        [--repeats 5] [--device cpu] [--out FILE]

No model is needed: the tokenizer is a byte-level BPE vocabulary of random 2-9 character tokens
(letters, digits, JSON punctuation) of the given size, the grammar a two-field JSON schema, each
request at its own point of one valid output. Prints the median over the repeats of each part.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

from adaspec.bench.conditions import engine_commit, hardware, now_iso
from adaspec.models.tokenizer import Tokenizer
from adaspec.sample import structured_outputs as so
from adaspec.sample.logits_rules import LogitsRule, RuleRow
from adaspec.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TEXT = '{"name": "Bob Smith", "age": 42}'


def random_tokenizer(vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    rng = random.Random(0)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789Ġ{}\":,[]._-"
    while len(vocab) < vocab_size - 1:
        vocab.setdefault("".join(rng.choice(chars) for _ in range(rng.randint(2, 9))), len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(tok, {}, {vocab_size - 1})


class History:
    request_id = "bench"
    grammar_state = None


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--requests", default="1,64,256")
    ap.add_argument("--positions", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    V, eos = args.vocab, {args.vocab - 1}
    tok = random_tokenizer(V)
    t0 = time.perf_counter()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    rule = LogitsRule.of(params, eos, V, tok)
    first_ms = 1e3 * (time.perf_counter() - t0)  # llguidance's view of the tokenizer, then the grammar

    def compile_afresh():
        so._pools.clear()  # the compiled grammars kept per tokenizer: time a compile, not a hit
        LogitsRule.of(params, eos, V, tok)

    compile_ms = median_ms(compile_afresh, args.repeats)
    cached_ms = median_ms(lambda: LogitsRule.of(params, eos, V, tok), args.repeats)
    ids = tok.encode(TEXT)
    results = []
    print(f"vocabulary {V}, {os.cpu_count()} CPUs; first compile {first_ms:.0f} ms, later ones {compile_ms:.1f} ms, "
          f"the same grammar again (kept) {cached_ms:.2f} ms")
    print(f"{'requests':>8} {'positions':>9} {'rows':>6} {'llguidance ms':>14} {'unpack ms':>10} {'whole mask ms':>14}")
    for R in [int(x) for x in args.requests.split(",")]:
        for P in [int(x) for x in args.positions.split(",")]:
            histories = [History() for _ in range(R)]
            rows = []
            for n in range(R):
                cut = 1 + n % (len(ids) - P)
                rows += [RuleRow(rule, 1.0, [], ids[:cut], ids[cut:cut + j], history=histories[n]) for j in range(P)]
            so.grammar_keep_mask(rows, V, args.device)  # the matchers made and brought up to the outputs
            matchers = [h.grammar_state.matcher for h in histories]
            words = (V + 31) // 32
            bits = torch.full((len(rows), words), -1, dtype=torch.int32)

            def llguidance_only():
                if P == 1:
                    so._executor.unsafe_compute_mask_ptr([(m, n) for n, m in enumerate(matchers)], bits.data_ptr(),
                                                         words * 4, len(rows))
                else:
                    so._executor.unsafe_compute_mask_ptr_with_draft_token(
                        [(m, n * P, list(rows[n * P + P - 1].extra)) for n, m in enumerate(matchers)],
                        bits.data_ptr(), words * 4, len(rows))

            packed = bits.to(args.device)
            table = so._bit_table(args.device)
            r = dict(requests=R, positions=P, rows=len(rows),
                     llguidance_ms=median_ms(llguidance_only, args.repeats),
                     unpack_ms=median_ms(lambda: table[packed.view(torch.uint8).long()], args.repeats),
                     whole_mask_ms=median_ms(lambda: so.grammar_keep_mask(rows, V, args.device), args.repeats))
            results.append(r)
            print(f"{R:>8} {P:>9} {len(rows):>6} {r['llguidance_ms']:>14.1f} {r['unpack_ms']:>10.1f} "
                  f"{r['whole_mask_ms']:>14.1f}")
    if args.out:
        conditions = dict(vars(args), schema=SCHEMA, text=TEXT, cpus=os.cpu_count(), hardware=hardware(),
                          torch=torch.__version__, engine_commit=engine_commit(), date=now_iso(),
                          first_compile_ms=first_ms, compile_ms=compile_ms, cached_compile_ms=cached_ms)
        with open(args.out, "w") as f:
            json.dump(dict(conditions=conditions, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
