"""τ of dflash+chain at T = 1 for each --draft-sampling named, on the first 5 prompts of a built-in set
(seed 0 each, 64 new tokens, torch fp32, the default pair).

    python scripts/draft_sampling_tau.py humaneval walk drafter
"""

import argparse


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prompts", help="a built-in prompt set (humaneval, mbpp, ...)")
    p.add_argument("modes", nargs="+", help="--draft-sampling modes to compare (walk, drafter, ...)")
    args = p.parse_args()

    from loopspec.decoding import SamplingParams
    from loopspec.runtime.bench import load_prompts
    from loopspec.runtime.pipeline import EngineChoice, open_pipeline

    pipe = open_pipeline(EngineChoice(backend="torch", precision="fp32"))
    prompts = load_prompts(args.prompts, limit=5)
    for mode in args.modes:
        s = pipe.settings("dflash", tree_budget=0, suffix=False, suffix_first=0, adaptive=False, draft_sampling=mode)
        committed = rounds = 0
        for text in prompts:
            r = pipe.run(pipe.encode(text), s, max_new_tokens=64, params=SamplingParams(temperature=1.0), seed=0)
            committed += sum(a + 1 for a in r.stats.accepted_per_round)
            rounds += len(r.stats.accepted_per_round)
        print(f"{args.prompts} {mode}: tau {committed / rounds:.3f} over {rounds} rounds", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
