"""``vllm-kvcomp eval``: run the long-context tasks through a server under several policies.

``vllm-kvcomp eval --help`` lists the tasks and shows :data:`EXAMPLES`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
EXAMPLES = """\
examples (against `vllm-kvcomp serve --port 8000`, which serves SmolLM2-135M-Instruct):
  vllm-kvcomp eval --url http://localhost:8000 --model SmolLM2-135M-Instruct \\
      --tasks passkey64,niah --policies full,lagkv,snapkv --ratios 0.25 --lengths 2k --samples 5
  vllm-kvcomp eval --url http://localhost:8000 --model SmolLM2-135M-Instruct --scope context \\
      --policies full,lagkv,snapkv,lagkv:lag=64 --ratios 0.5,0.25 --lengths 2k,4k --samples 10 \\
      --out kvcomp-eval/context.jsonl --plots kvcomp-eval/plots
  vllm-kvcomp eval --report-only --out kvcomp-eval/context.jsonl"""


def _csv(text: str, cast: Callable[[str], T]) -> list[T]:
    try:
        return [cast(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise ValueError(f"bad list {text!r}: {err}") from None


def parse_length(text: str) -> int:
    """``4096`` or ``4k`` (= 4096 tokens)."""
    text = text.lower()
    value = int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)
    if value <= 0:
        raise ValueError(f"length must be positive, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_kvcomp.eval.tasks import TASKS

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("tasks:\n" + "\n".join(f"  {t.name:<11} {t.description}" for t in TASKS.values())
                     + "\n\n" + EXAMPLES)
    parser.add_argument("--url", help="server URL, e.g. http://localhost:8000 (/v1 is added)")
    parser.add_argument("--model", help="served model name (the request's `model`)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    parser.add_argument("--api", choices=("chat", "completions"), default="chat",
                        help="chat messages, or one plain-text prompt per request")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma list (default: all)")
    parser.add_argument("--policies", default="full,lagkv",
                        help="comma list; full = baseline; NAME:key=value[:key=value] adds "
                             "settings (lagkv:lag=64), NAME:ratio=R runs only at R")
    parser.add_argument("--ratios", default="0.5,0.25", help="kept fractions, comma list")
    parser.add_argument("--scope", choices=("all", "context"), default="all",
                        help="context: the document and the question are separate chat messages (every "
                             "condition) and compressing conditions send scope=context, so the question is "
                             "never compressed (kvpress's leaderboard protocol); needs --api chat")
    parser.add_argument("--lengths", default="1k,2k,4k",
                        help="prompt lengths in the model's tokens, comma list (4k = 4096)")
    parser.add_argument("--depths", default="0,25,50,75,100",
                        help="needle depths in percent; sample i uses depth i mod len(depths)")
    parser.add_argument("--samples", type=int, default=5, help="samples per task and length")
    parser.add_argument("--claim-samples", type=int, default=0,
                        help="at least this many samples in the cells the papers' claims read "
                             "(vllm_kvcomp.eval.claims.CLAIMS)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="kvcomp-eval/results.jsonl",
                        help="results JSONL, appended to and resumed from")
    parser.add_argument("--summary", help="markdown summary (default: --out with .md)")
    parser.add_argument("--plots", help="folder for PNG plots (none if not given)")
    parser.add_argument("--tokenizer", help="tokenizer folder/file (default: the bundled model)")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="size prompts by a chars-per-token estimate instead")
    parser.add_argument("--chars-per-token", type=float, default=4.0)
    parser.add_argument("--haystack", help="folder of .txt essays instead of the Paul Graham set")
    parser.add_argument("--max-tokens", type=int, help="override every task's reply budget")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--max-errors", type=int, default=10, help="stop after this many failures")
    parser.add_argument("--report-only", action="store_true",
                        help="only rebuild the summary and plots from --out")


def _counter(args: argparse.Namespace):
    from vllm_kvcomp.eval.tasks.sizing import CharEstimateCounter, load_counter

    if args.no_tokenizer:
        return CharEstimateCounter(args.chars_per_token)
    if args.tokenizer:
        return load_counter(Path(args.tokenizer))
    from vllm_kvcomp.models import default_model_dir

    folder = default_model_dir()
    if not folder.is_dir():
        raise FileNotFoundError(f"no bundled model at {folder} to take the tokenizer from: run "
                                "`vllm-kvcomp model`, or pass --tokenizer PATH or --no-tokenizer")
    return load_counter(folder)


def _evaluate(args: argparse.Namespace) -> list[dict]:
    from vllm_kvcomp.eval import claims, runner
    from vllm_kvcomp.eval.haystack import essay_sentences
    from vllm_kvcomp.eval.tasks import TaskContext

    if not args.url or not args.model:
        raise ValueError("--url and --model are required (or pass --report-only)")
    if args.samples < 1:
        raise ValueError(f"--samples must be at least 1, got {args.samples}")
    depths = tuple(d / 100.0 for d in _csv(args.depths, float))
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"--depths must be percentages in [0, 100], got {args.depths!r}")
    if args.scope == "context" and args.api != "chat":
        raise ValueError("--scope context needs --api chat (the server counts the context as the messages "
                         "before the last user message; raw completions would have to send context_tokens)")
    conds = runner.conditions(_csv(args.policies, str), _csv(args.ratios, float), args.scope)
    extra = claims.claim_samples(args.claim_samples) if args.claim_samples > 0 else None
    work = runner.schedule(_csv(args.tasks, str), _csv(args.lengths, parse_length), conds,
                           args.samples, extra)
    haystack = Path(args.haystack) if args.haystack else None
    ctx = TaskContext(args.seed, _counter(args), depths, lambda: essay_sentences(haystack))
    settings = runner.Settings(args.url, args.model, args.api_key, args.api, args.max_tokens,
                               args.concurrency, args.timeout, args.max_errors)
    out = Path(args.out)
    stats = runner.run_work(ctx, work, settings, out)
    print(f"sent {stats.sent}, resumed past {stats.skipped}, failed {stats.errors}", file=sys.stderr)
    return [r for r in runner.read_jsonl(out) if r.get("key") in stats.keys]


def run(args: argparse.Namespace) -> int:
    from vllm_kvcomp.eval.report import report_markdown, write_report
    from vllm_kvcomp.eval.runner import read_jsonl

    out = Path(args.out)
    try:
        if args.report_only:
            records = [r for r in read_jsonl(out) if not args.model or r.get("model") == args.model]
        else:
            records = _evaluate(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"vllm-kvcomp eval: error: {err}", file=sys.stderr)
        return 2
    summary = Path(args.summary) if args.summary else out.with_suffix(".md")
    plots = Path(args.plots) if args.plots else None
    rows = write_report(records, summary, plots)
    print(report_markdown(rows))
    print(f"results: {out}\nsummary: {summary}" + (f"\nplots: {plots}" if plots else ""),
          file=sys.stderr)
    return 0
