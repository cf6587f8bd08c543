"""``vllm-kvcomp calibrate``: measure RazorAttention retrieval heads, POD layer groups, train
DuoAttention head gates and/or a KVzap scorer.

Runs the model with Hugging Face transformers on CPU in float32 and writes
``<model>/kvcomp_profiles/<kind>[.<name>].json`` (or into ``--out``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_kvcomp.calibration import duo_attention, kvzap, layer_groups, retrieval_heads
from vllm_kvcomp.calibration.profiles import (
    DEFAULT_NAME,
    KINDS,
    PROFILE_DIRNAME,
    ModelIdentity,
    Profile,
    ProfileError,
    check_name,
    compressed_layers,
    profile_path,
    save_profile,
    store_dir,
)

EXAMPLES = """\
examples (without --model: the bundled SmolLM2, fetched on first use):
  vllm-kvcomp calibrate --kind razor --out /tmp/profiles
  vllm-kvcomp calibrate --kind pod --delta 0.6 --out /tmp/profiles
  vllm-kvcomp calibrate --kind duoattention --threads 1 --out /tmp/profiles
  vllm-kvcomp calibrate --kind kvzap --out /tmp/profiles
  vllm-kvcomp calibrate --kind razor --seed 1 --name seed1"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    rh, lg = retrieval_heads.DEFAULTS, layer_groups.DEFAULTS
    parser.epilog = EXAMPLES
    parser.add_argument("--model", default=None, help="HF model folder (default: the bundled SmolLM2)")
    parser.add_argument("--kind", choices=(*KINDS, "all"), default="all",
                        help="which profile(s); all: every kind (duoattention trains for tens of minutes)")
    parser.add_argument("--name", default=DEFAULT_NAME, help="profile name (default: %(default)s)")
    parser.add_argument("--out", default=None, help=f"output folder (default: <model>/{PROFILE_DIRNAME})")
    parser.add_argument("--store", action="store_true",
                        help="write into the package's profile store (how the bundled model's profiles are made)")
    parser.add_argument("--seed", type=int, default=rh["seed"], help="random seed (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    razor = parser.add_argument_group("razor (retrieval heads)")
    razor.add_argument("--length", type=int, default=rh["length"], help="random block length K (default: %(default)s)")
    razor.add_argument("--repeats", type=int, default=rh["repeats"], help="block repeats (default: %(default)s)")
    razor.add_argument("--samples", type=int, default=rh["samples"], help="random sequences (default: %(default)s)")
    razor.add_argument("--induction", type=float, default=rh["induction_fraction"],
                       help="fraction of query heads kept by induction score (default: %(default)s)")
    razor.add_argument("--echo", type=float, default=rh["echo_fraction"],
                       help="fraction of query heads kept by echo score (default: %(default)s)")
    pod = parser.add_argument_group("pod (layer groups)")
    pod.add_argument("--pod-samples", type=int, default=lg["samples"], help="text samples (default: %(default)s)")
    pod.add_argument("--pod-words", type=int, default=lg["words"], help="words per text sample (default: %(default)s)")
    pod.add_argument("--pod-last", type=int, default=lg["last"], help="last queries compared (default: %(default)s)")
    pod.add_argument("--delta", type=float, default=lg["delta"], help="grouping threshold (default: %(default)s)")
    duo = parser.add_argument_group("duoattention (trained gates)")
    for key, kind, what in (
        ("steps", int, "optimisation steps, one sample each"), ("lr", float, "AdamW learning rate"),
        ("reg", float, "weight of the L1 penalty on the gates"),
        ("min-length", int, "shortest haystack (tokens)"), ("max-length", int, "longest haystack (tokens)"),
        ("sink", int, "streaming attention's sink tokens"), ("recent", int, "streaming attention's recent tokens"),
        ("passkeys", int, "passkeys per sample"), ("passkey-words", int, "words per passkey"),
        ("threshold", float, "gate at or above which a head is a retrieval head"),
    ):
        default = duo_attention.DEFAULTS[key.replace("-", "_")]
        duo.add_argument(f"--duo-{key}", type=kind, default=default, help=f"{what} (default: {default})")
    zap = parser.add_argument_group("kvzap (a scorer trained on KVzip's scores)")
    for key, kind, what in (
        ("samples", int, "texts replayed (the last --kvzap-holdout held out)"), ("holdout", int, "texts held out"),
        ("words", int, "words per text"), ("needles", int, "facts with a number per text"),
        ("ridge", float, "ridge penalty per row on standardised features"),
    ):
        default = kvzap.DEFAULTS[key]
        zap.add_argument(f"--kvzap-{key}", type=kind, default=default, help=f"{what} (default: {default})")


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from vllm_kvcomp.calibration.probe import hf_provider, load_hf_model

    try:
        check_name(args.name)
    except ProfileError as err:
        raise SystemExit(f"--name: {err}") from None
    model_dir = Path(args.model) if args.model else _default_model(progress=not args.quiet)
    identity = ModelIdentity.from_model_dir(model_dir)
    if args.store:
        args.out = str(store_dir(identity))
    model = load_hf_model(str(model_dir), threads=args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    progress = not args.quiet
    kinds = KINDS if args.kind == "all" else (args.kind,)
    summary: dict[str, object] = {"model": str(model_dir)}
    with hf_provider(model) as provider:
        if "razor" in kinds:
            bos = model.config.bos_token_id
            profile = retrieval_heads.calibrate_retrieval_heads(
                provider, identity, model.config.vocab_size,
                length=args.length, repeats=args.repeats, samples=args.samples,
                induction_fraction=args.induction, echo_fraction=args.echo, seed=args.seed,
                exclude=tokenizer.all_special_ids, prefix=[bos] if bos is not None else [],
                name=args.name, progress=progress,
            )
            path = _save(profile, model_dir, args.out)
            summary["razor"] = {"path": str(path), "kv_heads": sorted(profile.kv_heads),
                                "count": f"{len(profile.kv_heads)}/{identity.num_layers * identity.num_kv_heads}"}
        if "pod" in kinds:
            sequences = [
                torch.tensor(tokenizer(layer_groups.pseudo_text(args.pod_words, args.seed + i))["input_ids"])
                for i in range(args.pod_samples)
            ]
            groups = layer_groups.calibrate_layer_groups(
                provider, identity, sequences, delta=args.delta, last=args.pod_last,
                settings={"words": args.pod_words, "seed": args.seed}, name=args.name, progress=progress,
            )
            path = _save(groups, model_dir, args.out)
            summary["pod"] = {"path": str(path), "groups": [list(g) for g in groups.groups]}
        if "kvzap" in kinds:
            bos = model.config.bos_token_id
            scorer = kvzap.calibrate_kvzap(
                provider, lambda text: tokenizer.encode(text, add_special_tokens=False), identity,
                prefix=[bos] if bos is not None else [], seed=args.seed, name=args.name, progress=progress,
                compressed=compressed_layers(getattr(model.config, "layer_types", None)) or None,
                **{key: getattr(args, f"kvzap_{key}") for key in kvzap.DEFAULTS if key != "seed"},
            )
            path = _save(scorer, model_dir, args.out)
            summary["kvzap"] = {"path": str(path), **{k: scorer.settings[k] for k in ("r2", "train_tokens", "seconds")}}
    if "duoattention" in kinds:
        summary["duoattention"] = _duoattention(args, model, tokenizer, identity, model_dir)
    print(json.dumps(summary, indent=1))
    return 0


def _default_model(progress: bool) -> Path:
    from vllm_kvcomp.models import fetch_default_model

    return fetch_default_model(progress=progress)


def _duoattention(args: argparse.Namespace, model: object, tokenizer: object, identity: ModelIdentity,
                  model_dir: Path) -> dict[str, object]:
    """Train, save and summarise the DuoAttention gates."""
    from vllm_kvcomp.policies.duoattention import retrieval_heads as duo_retrieval_heads

    bos = model.config.bos_token_id
    settings = {key: getattr(args, f"duo_{key}") for key in duo_attention.DEFAULTS if key not in ("intervals", "seed")}
    profile = duo_attention.calibrate_duo_attention(
        model, lambda text: tokenizer.encode(text, add_special_tokens=False), identity,
        prefix=[bos] if bos is not None else [], name=args.name, progress=not args.quiet, seed=args.seed, **settings,
    )
    path = _save(profile, model_dir, args.out)
    heads = duo_retrieval_heads(profile.gates, threshold=profile.threshold)
    return {"path": str(path), "retrieval_heads": f"{len(heads)}/{identity.num_layers * identity.num_kv_heads}",
            "seconds": profile.settings["seconds"], "final_distill": profile.settings["final_distill"]}


def _save(profile: Profile, model_dir: Path, out: str | None) -> Path:
    if out is None:
        return save_profile(profile, model_dir=model_dir)
    return save_profile(profile, path=Path(out) / profile_path(".", profile.kind, profile.name).name)
