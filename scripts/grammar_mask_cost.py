"""Per-token cost of a grammar's token mask, llguidance against xgrammar, on the default target's
tokenizer (SmolLM2-135M-Instruct, 49152 tokens): what constrained decoding adds to every verified
node (runtime/constraint.py computes one mask per node of every draft tree).

For each grammar (a JSON schema, a regular expression) a valid text is tokenized as the model would
write it, and each library's matcher walks it token by token: at every position the next-token mask
is filled (`mask`), then the token is consumed (`advance`); after the walk it is rolled back token by
token (`rollback`). The walk is repeated and each step's median is kept. Compilation (grammar →
matcher, once per request) is timed once per library after a warm-up.

    python scripts/grammar_mask_cost.py --out docs/runs/2026-12-06/grammar-mask-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from loopspec.runtime.step_costs import cpu_name

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "role", "active"],
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "email": "ada@example.org",
        "tags": ["mathematics", "engines", "poetry"],
        "role": "admin",
        "active": True,
    },
    separators=(", ", ": "),
)
REGEX = r"[A-Z][a-z]+ (\d{1,3}|many) (apples|pears|plums)(, [a-z]+ [0-9]{2,4})*\."
REGEX_TEXT = "Alice 42 pears, bob 1234, carol 56, dave 789, erin 2025, frank 31, grace 777."


def walk(fill, advance, rollback, tokens: list[int], repeats: int) -> dict:
    """Median µs per token of fill / advance / rollback over `repeats` walks of `tokens`."""
    times = {"mask": [], "advance": [], "rollback": []}
    for _ in range(repeats):
        for token in tokens:
            t0 = time.perf_counter()
            fill()
            t1 = time.perf_counter()
            advance(token)
            t2 = time.perf_counter()
            times["mask"].append(t1 - t0)
            times["advance"].append(t2 - t1)
        for _ in tokens:
            t0 = time.perf_counter()
            rollback()
            times["rollback"].append(time.perf_counter() - t0)
    return {f"{name}_us_median": round(statistics.median(v) * 1e6, 2) for name, v in times.items()} | {
        "mask_us_p90": round(sorted(times["mask"])[int(0.9 * len(times["mask"]))] * 1e6, 2),
        "mask_us_mean": round(statistics.fmean(times["mask"]) * 1e6, 2),
    }


def llguidance_case(tokenizer, grammar_of, text: str, repeats: int) -> dict:
    """llguidance over loopspec's table of the tokenizer's bytes (runtime/constraint.py token_bytes;
    llguidance's own reading of this tokenizer.json takes its byte-level tokens for text)."""
    import llguidance
    import llguidance.torch

    from loopspec.runtime.constraint import token_bytes

    class Vocabulary:  # what llguidance.TokenizerWrapper reads
        tokens, eos_token_id, bos_token_id = token_bytes(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id
        special_token_ids = list(tokenizer.all_special_ids)

        def __call__(self, text):
            return tokenizer.encode(text, add_special_tokens=False)

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()))
    tokenizer_s = time.perf_counter() - t0
    grammar = grammar_of(llguidance.LLMatcher)
    llguidance.LLMatcher(lltok, grammar)  # warm-up
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert matcher.validate_tokens(tokens) == len(tokens), "llguidance refuses the sample's tokens"
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)

    def advance(token):
        assert matcher.consume_token(token)

    out = walk(
        lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
        advance,
        lambda: matcher.rollback(1),
        tokens,
        repeats,
    )
    return {
        "tokens": len(tokens),
        "compile_ms": round(compile_s * 1e3, 2),
        "tokenizer_setup_ms": round(tokenizer_s * 1e3, 1),
    } | out


def xgrammar_case(tokenizer, spec, text: str, repeats: int) -> dict:
    """xgrammar as loopspec runs it (runtime/constraint.py: Grammars over the tokenizer's bytes);
    `allowed_us_median`: loopspec's whole per-node mask, the bitmask unpacked to a bool tensor."""
    from loopspec.runtime.constraint import Grammars

    t0 = time.perf_counter()
    grammars = Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    tokenizer_s = time.perf_counter() - t0
    grammars.constraint(spec)  # warm-up
    grammars.compiler.clear_cache()
    t0 = time.perf_counter()
    constraint = grammars.constraint(spec)
    compile_s = time.perf_counter() - t0
    matcher, bitmask = constraint.matcher, constraint.bitmask
    tokens = tokenizer.encode(text, add_special_tokens=False)

    def advance(token):
        assert matcher.accept_token(token), f"xgrammar refuses token {token}"

    out = walk(lambda: matcher.fill_next_token_bitmask(bitmask), advance, lambda: matcher.rollback(1), tokens, repeats)
    allowed = walk(constraint.current_mask, advance, lambda: matcher.rollback(1), tokens, repeats)
    return (
        {
            "tokens": len(tokens),
            "compile_ms": round(compile_s * 1e3, 2),
            "tokenizer_setup_ms": round(tokenizer_s * 1e3, 1),
        }
        | out
        | {"allowed_us_median": allowed["mask_us_median"]}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    args = parser.parse_args()

    import llguidance
    import xgrammar

    from loopspec.runtime.constraint import GrammarSpec
    from loopspec.weights import TargetSource, load_tokenizer

    tokenizer = load_tokenizer(TargetSource.of("default").checkpoint_dir())
    vocab = len(tokenizer)
    schema = json.dumps(SCHEMA)  # llguidance: its default JSON whitespace, as loopspec's (", ", ": ")
    results = {
        "json_schema": {
            "llguidance": llguidance_case(
                tokenizer,
                lambda m: m.grammar_from_json_schema(schema, overrides={"item_separator": ", ", "key_separator": ": "}),
                SCHEMA_TEXT,
                args.repeats,
            ),
            "xgrammar": xgrammar_case(tokenizer, GrammarSpec("json_schema", SCHEMA), SCHEMA_TEXT, args.repeats),
        },
        "regex": {
            "llguidance": llguidance_case(tokenizer, lambda m: m.grammar_from_regex(REGEX), REGEX_TEXT, args.repeats),
            "xgrammar": xgrammar_case(tokenizer, GrammarSpec("regex", REGEX), REGEX_TEXT, args.repeats),
        },
    }
    report = {
        "what": "µs per token: next-token mask fill, advance (consume), rollback; medians of "
        f"{args.repeats} walks over a valid sample",
        "cpu": cpu_name(),
        "cores": __import__("os").cpu_count(),
        "note": args.note,
        "tokenizer": "SmolLM2-135M-Instruct (the default target)",
        "vocab_size": vocab,
        "versions": {
            "llguidance": llguidance.get_version() if hasattr(llguidance, "get_version") else "?",
            "xgrammar": getattr(xgrammar, "__version__", "?"),
        },
        "schema": SCHEMA,
        "schema_sample": SCHEMA_TEXT,
        "regex": REGEX,
        "regex_sample": REGEX_TEXT,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    for grammar, libs in results.items():
        for lib, r in libs.items():
            print(
                f"{grammar:12s} {lib:11s} mask {r['mask_us_median']:6.1f} µs "
                f"(mean {r['mask_us_mean']:.1f}, p90 {r['mask_us_p90']:.1f})  "
                f"advance {r['advance_us_median']:6.1f} µs  rollback {r['rollback_us_median']:6.1f} µs  "
                f"compile {r['compile_ms']:.1f} ms"
                + (f"  loopspec's bool mask {r['allowed_us_median']:.1f} µs" if "allowed_us_median" in r else "")
            )


if __name__ == "__main__":
    main()
