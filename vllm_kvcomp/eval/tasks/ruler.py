"""RULER's synthetic tracing and aggregation tasks (Hsieh et al., 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?"): ``vt``, ``cwe`` and ``fwe``.

They follow RULER's generators and templates (NVIDIA/RULER, ``scripts/data/synthetic``:
``variable_tracking.py``, ``common_words_extraction.py``, ``freq_words_extraction.py``,
``constants.py``). Every answer is a word, scored by the fraction of them in the reply as whole
words, case-insensitive (``words``, RULER's ``string_match_all``). This harness sends user
messages only, so RULER's answer prefix (``Answer: ... they are:``, the start of the model's
turn) becomes a short answer instruction at the end of the question. No few-shot example.

- ``vt`` (multi-hop tracing): one chain of :data:`VT_HOPS` hops, ``VAR ABCDE = 12345`` then
  ``VAR FGHIJ = VAR ABCDE`` and so on (names of five random capitals), in the passkey noise
  (``The grass is green. The sky is blue. ...``), statement ``j`` of ``n`` at a random depth in
  ``[j/n, (j+1)/n]`` so they are spread out and in order. Asks for every variable that is
  assigned the value; the answers are all names of the chain.
- ``cwe`` (aggregation): a numbered list ``1. word 2. word ...`` of words from :data:`WORDS`,
  shuffled: each of :data:`CWE_COMMON` common words ``fc`` times, each uncommon word ``fu`` times
  (RULER: 6 and 1 below 4096 tokens, 30 and 3 from there on); the number of uncommon words is
  what meets the length. Short prompts lower ``fc`` so that the common words take at most half the
  list (never below ``fu + 1``); prompts that would need more uncommon words than :data:`WORDS`
  holds multiply ``fc`` and ``fu`` by the same factor; one uncommon word may occur fewer than
  ``fu`` times so the length is met closely. Common words always occur more often than any other.
  Asks for the common words.
- ``fwe`` (aggregation): coded words (:data:`FWE_WORD_LEN` random lowercase letters) with
  RULER's Zipf counts: for a scale ``n``, the word of rank ``k`` occurs
  ``floor(n * k**-2 / zeta(2))`` times (alpha = 2; ranks whose count floors to 0 are left out),
  shuffled and joined by spaces. Rank 1 is the noise ``...``; the answers are ranks 2 to 4, the
  three most frequent coded words, strictly ahead of rank 5 for every ``n >= 74``
  (:data:`FWE_MIN_SCALE`). The largest ``n`` whose prompt fits the length, plus as many more
  noise words as close the gap (a step of ``n`` can add several words), meets the length.

Lengths are met by searching the one size that grows the prompt (:func:`fit_scale`); vt's noise
is sized by :func:`~vllm_kvcomp.eval.tasks.sizing.fit_prompt`, as for the passkey.
"""

from __future__ import annotations

import itertools
import math
import re
import string
from collections.abc import Callable
from functools import partial
from random import Random

from vllm_kvcomp.eval.tasks.base import Sample, TaskContext, TaskInfo, Turn
from vllm_kvcomp.eval.tasks.passkey import FILLER
from vllm_kvcomp.eval.tasks.sizing import Needle, TokenCounter, fit_prompt, tolerance

VT_HOPS = 4
VT_NAME_LEN = 5
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = ("Question: Find all variables that are assigned the value {value} in the text above. "
               "Answer with the names of the {n} variables only.")
VT_ANSWER_START = ("Answer: According to the chain(s) of variable assignment in the text above, {n} "
                   "variables are assigned the value {value}, they are:")

CWE_COMMON = 10
CWE_FREQ_SHORT = (6, 1)  # (common, uncommon) occurrences below CWE_LONG tokens, as in RULER
CWE_FREQ_LONG = (30, 3)
CWE_LONG = 4096
CWE_MIN_UNCOMMON = 10  # uncommon entries in the shortest list
CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than "
             "others. Memorize the ones that appear most often.")
CWE_QUESTION = (f"Question: What are the {CWE_COMMON} most common words in the above list? "
                f"Answer with the {CWE_COMMON} words only.")
CWE_ANSWER_START = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"

FWE_ANSWERS = 3
FWE_WORD_LEN = 6
FWE_ALPHA = 2
FWE_ZETA = math.pi ** 2 / 6  # zeta(FWE_ALPHA)
FWE_NOISE = "..."
FWE_MIN_SCALE = 80  # any scale >= 74 puts rank 4 strictly ahead of rank 5
FWE_INTRO = ("Read the following coded text and track the frequency of each coded word. Find the "
             "three most frequently appeared coded words.")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are "
                "the three most frequently appeared words in the above coded text?")
FWE_ANSWER_START = "Answer: According to the coded text above, the three most frequently appeared words are:"

_WORD_TEXT = """
    able acorn anchor angry ankle apple arm army arrow art attic aunt baby bad badge bag
    bagel bait bald ball band banjo bank barn barrel base basket bath beach bead beam bean
    bear beard bed bee beef beetle bell belt bench berry big bike bird bitter black blade
    blanket blood blossom blue boat body bold bone bonnet book boot bottle bow bowl box boy
    bracelet brain branch brass brave bread breeze brick bridge brief bright broad broken
    bronze brother brown brush bubble bucket buckle buffalo bulb bus bush busy butter button
    cabin cactus cake calm camel camera camp candle canoe canyon cap car card carpet carrot
    cart castle cat cave cedar cellar cereal chain chair chalk cheap cheese cherry chest
    chicken child chimney chin church cider circle city clam class clay clean clear clever
    clock cloth cloud clover coal coat cobra cocoa coin cold collar comb comet compass cook
    cookie cool copper coral corn cotton cough cow crab crack crate cream crib cricket crisp
    crow crown cruel crystal cup cupboard curly curtain cushion dad daisy damp dark deep
    deer dense desk dim dinner dirt dirty dizzy dog doll dolphin donkey door dragon drain
    drawer dress drink drop drum dry duck dull dust dusty eager eagle ear early earth easel
    easy edge egg elbow empty engine eye face faint fair falcon fan fancy farm fast father
    feast feather fence fiddle field fierce finger fire firm fish flag flame flat flock
    floor flower fluffy flute fog fond foolish foot fork fossil fountain fowl free fresh
    frog fruit full funny furnace galaxy game garden garlic gate gentle ghost giant girl
    glad glass glove goat gold golden good goose grain grand grape grass gravel gray great
    green grumpy guitar hair hall hammer hamster hand happy harbor hard harp harsh hat hay
    head heart heavy hedge helmet hen hermit high hill hippo hole hollow home honest honey
    hook horn hornet horse hose hot house huge humble hungry ice icy idle igloo ink iron
    island jacket jaguar jam jar jeans jelly jewel jolly judge juice kayak keen kernel
    kettle key kind kite kitten knee knife knot lace ladder ladle lake lamp land lantern
    large late lazy leaf lean leg lemon lemur letter lily lip little lively lizard loaf
    lobster lock locket lone long loose loud lovely low lucky lunch magnet mango map maple
    marble mask meadow meal meat mellow melon mild milk mint mirror misty mitten modern
    moist monkey moon moose mother motor mouse mouth muffin mule mushroom nail napkin narrow
    nasty neat neck nectar needle nest net new nice night noble noisy noodle nose nut nutmeg
    oak oar ocean odd office oil old olive onion orange orchard ostrich otter oven owl
    oyster paddle pail palace pale pan panda paper park parrot peach peanut pear pebble
    pelican pen pencil penguin pepper pet piano pickle pie pig pillow pin pipe pirate plain
    plane planet plant plate plow plum plump pocket polite pond pony poor pot potato proud
    pumpkin puppy pure purple puzzle quartz quick quiet quill quilt rabbit raccoon radish
    rail rain rake rapid rare rat raven raw ray red ribbon rice rich ring ripe river road
    robin rock rocket rod roof room root rope rose rough round royal rude rug rusty sad
    saddle safe sail salmon salt salty sand sandal satin scale scarf scary school screw sea
    seed shark sharp sheep shelf shell shiny ship shirt shoe shop short shovel shy silent
    silk silly simple sink skirt sky sled slim slope slow small smart smoke smooth snail
    snake sneeze snow soap sock soda sofa soft solid son soup sour spade sparrow spicy
    spider sponge spoon spring square squash squid stamp star statue steak steam steep stem
    stick sticky stiff stone stove strange straw stream street strict string strong sturdy
    sugar suit sun sunny sunset swan sweet swift swing table tablet tail tall tame tank tart
    teapot tent thick thimble thin thistle thread throat thumb ticket tidy tiger timber tiny
    toad toast toe tomato tongue tooth tortoise tough towel town toy train tray tree truck
    trumpet tub tulip tunnel turkey turnip twig umbrella uncle valley van vase vast velvet
    vest village violin wafer wagon wall walnut walrus wand warm water wave wax weak weary
    wet whale wheel whip whistle white whole wide wild willow wind window wing wire wise
    witty wolf wood wool worm wrist yard yarn yogurt young zebra zoo
"""


def _words_of(*texts: str) -> frozenset[str]:
    """The lowercased words of ``texts``."""
    return frozenset(w.lower() for text in texts for w in re.findall(r"[A-Za-z]+", text))


# cwe's vocabulary: short English nouns and adjectives, none a word of its instructions
WORDS = tuple(sorted(set(_WORD_TEXT.split()) - _words_of(CWE_INTRO, CWE_QUESTION)))

_TEMPLATE_WORDS = _words_of(VT_INTRO, VT_QUESTION, CWE_INTRO, CWE_QUESTION, FWE_INTRO,
                             FWE_QUESTION, *FILLER)


def _render(intro: str, question: str) -> Callable[[str], str]:
    return lambda body: f"{intro}\n\n{body}\n\n{question}"


def _random_words(rng: Random, n: int, letters: str, size: int) -> list[str]:
    """``n`` distinct random words, none a word of the instructions or the noise; the first ``k``
    are the same for every ``n >= k``."""
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        word = "".join(rng.choice(letters) for _ in range(size))
        if word not in seen and word.lower() not in _TEMPLATE_WORDS:
            seen.add(word)
            out.append(word)
    return out


def fit_scale(build: Callable[[int], str], counter: TokenCounter, target: int, lo: int,
              hi: int | None = None, *, under: bool = False) -> tuple[str, int, int]:
    """(prompt, tokens, scale) of ``build(scale)`` closest to ``target`` tokens (``under``: the
    largest at most ``target``), for ``lo <= scale`` (``<= hi`` if given); prompts grow with the
    scale, about linearly. Raises ``ValueError`` when even ``build(lo)`` is longer than ``target``.

    Brackets the target by extrapolating, then narrows the bracket by interpolation, bisecting
    whenever a step did not halve it.
    """
    cache: dict[int, tuple[str, int]] = {}

    def tokens(scale: int) -> int:
        if scale not in cache:
            prompt = build(scale)
            cache[scale] = prompt, counter.count(prompt)
        return cache[scale][1]

    if tokens(lo) > target:
        raise ValueError(f"a length of {target} tokens is too short: the smallest prompt takes "
                         f"{tokens(lo)} tokens")
    top = hi if hi is not None else 2 * lo
    while hi is None and tokens(top) <= target:
        slope = (tokens(top) - tokens(lo)) / (top - lo)
        step = math.ceil(1.1 * (target - tokens(top)) / slope) + 1 if slope > 0 else top
        lo, top = top, top + step
    if tokens(top) <= target:
        return (*cache[top], top)
    bisect = False
    while top - lo > 1:  # tokens(lo) <= target < tokens(top)
        width = top - lo
        if bisect:
            guess = (lo + top) // 2
        else:
            guess = lo + round((target - tokens(lo)) * width / (tokens(top) - tokens(lo)))
        guess = min(max(guess, lo + 1), top - 1)
        if tokens(guess) <= target:
            lo = guess
        else:
            top = guess
        bisect = top - lo > width // 2
    best = lo if under else min((lo, top), key=lambda s: abs(tokens(s) - target))
    return (*cache[best], best)


def variable_names(rng: Random, n: int) -> list[str]:
    """``n`` distinct names of :data:`VT_NAME_LEN` random capitals."""
    return _random_words(rng, n, string.ascii_uppercase, VT_NAME_LEN)


def make_vt(ctx: TaskContext, index: int, length: int) -> Sample:
    rng = ctx.rng("vt", length, index)
    pool = ctx.pool("passkey", lambda: FILLER)
    names = variable_names(rng, VT_HOPS + 1)
    value = str(rng.randint(10_000, 99_999))
    statements = [f"VAR {names[0]} = {value}"]
    statements += [f"VAR {b} = VAR {a}" for a, b in itertools.pairwise(names)]
    n = len(statements)
    needles = [Needle(s, rng.uniform(j / n, (j + 1) / n)) for j, s in enumerate(statements)]
    question = VT_QUESTION.format(value=value, n=n)
    prompt, tokens = fit_prompt(pool, 0, needles, length, _render(VT_INTRO, question))
    turn = Turn(prompt, tuple(names), "words", question=question,
                answer_start=VT_ANSWER_START.format(value=value, n=n))
    return Sample("vt", index, ctx.seed, length, tokens, (turn,), TASKS["vt"].max_tokens)


def cwe_frequencies(length: int, entries: float) -> tuple[int, int]:
    """(common, uncommon) occurrences for a list of about ``entries`` entries."""
    common, uncommon = CWE_FREQ_LONG if length >= CWE_LONG else CWE_FREQ_SHORT
    common = max(uncommon + 1, min(common, int(entries) // (2 * CWE_COMMON)))
    capacity = CWE_COMMON * common + uncommon * (len(WORDS) - CWE_COMMON)
    factor = max(1, math.ceil(entries / capacity))
    return common * factor, uncommon * factor


def numbered(words: list[str], start: int = 1) -> str:
    """``1. first 2. second ...`` (numbered from ``start``)."""
    return " ".join(f"{i}. {w}" for i, w in enumerate(words, start))


def make_cwe(ctx: TaskContext, index: int, length: int) -> Sample:
    rng = ctx.rng("cwe", length, index)
    words = rng.sample(WORDS, len(WORDS))
    common, uncommon = words[:CWE_COMMON], words[CWE_COMMON:]
    order = rng.getrandbits(64)
    render = _render(CWE_INTRO, CWE_QUESTION)
    counter = ctx.counter
    budget = length - counter.count(render(""))
    entries = budget / (counter.count(numbered(words[:100])) / 100)
    # most numbers in a long list have more digits: measure entries numbered from mid-list
    entries = budget / (counter.count(numbered(words[:100], int(entries) // 2 + 1)) / 100)
    while True:
        freq_common, freq_uncommon = cwe_frequencies(length, entries)

        def build(n: int, fc: int = freq_common, fu: int = freq_uncommon) -> str:
            """The list with ``n`` uncommon entries: ``n // fu`` words ``fu`` times, one the rest."""
            full, rest = divmod(n, fu)
            listed = common * fc + uncommon[:full] * fu + uncommon[full:full + 1] * rest
            Random(order).shuffle(listed)
            return render(numbered(listed))

        most = freq_uncommon * len(uncommon)
        prompt, tokens, n = fit_scale(build, counter, length, CWE_MIN_UNCOMMON, most)
        if n < most or abs(tokens - length) <= tolerance(length):
            break
        entries *= 1.25  # even the most uncommon words were too few: raise both frequencies
    turn = Turn(prompt, tuple(common), "words", question=CWE_QUESTION, answer_start=CWE_ANSWER_START)
    return Sample("cwe", index, ctx.seed, length, tokens, (turn,), TASKS["cwe"].max_tokens)


def zipf_counts(scale: int) -> list[int]:
    """RULER's occurrences by rank: ``floor(scale * k**-alpha / zeta(alpha))`` while at least 1."""
    counts: list[int] = []
    while (c := int(scale / ((len(counts) + 1) ** FWE_ALPHA * FWE_ZETA))) >= 1:
        counts.append(c)
    return counts


def coded_words(seed: int, n: int) -> list[str]:
    """The first ``n`` coded words of a sample (the same prefix for every ``n``)."""
    return _random_words(Random(seed), n, string.ascii_lowercase, FWE_WORD_LEN)


def make_fwe(ctx: TaskContext, index: int, length: int) -> Sample:
    rng = ctx.rng("fwe", length, index)
    vocab_seed, order = rng.getrandbits(64), rng.getrandbits(64)
    render = _render(FWE_INTRO, FWE_QUESTION)

    def build(scale: int, dots: int = 0) -> str:
        """The coded text at ``scale``, with ``dots`` more noise words."""
        counts = zipf_counts(scale)
        counts[0] += dots
        vocab = [FWE_NOISE, *coded_words(vocab_seed, len(counts) - 1)]
        text = [w for w, c in zip(vocab, counts) for _ in range(c)]
        Random(order).shuffle(text)
        return render(" ".join(text))

    # the scale's steps add several words at once; extra noise closes the last gap
    _, under, scale = fit_scale(build, ctx.counter, length, FWE_MIN_SCALE, under=True)
    prompt, tokens, _ = fit_scale(partial(build, scale), ctx.counter, length, 0, length - under)
    counts = zipf_counts(scale)
    if len(counts) > FWE_ANSWERS + 1 and counts[FWE_ANSWERS] <= counts[FWE_ANSWERS + 1]:
        raise RuntimeError(f"fwe scale {scale}: the top {FWE_ANSWERS} words are not unambiguous")
    answers = tuple(coded_words(vocab_seed, FWE_ANSWERS))
    turn = Turn(prompt, answers, "words", question=FWE_QUESTION, answer_start=FWE_ANSWER_START)
    return Sample("fwe", index, ctx.seed, length, tokens, (turn,), TASKS["fwe"].max_tokens)


TASKS = {
    t.name: t
    for t in (
        TaskInfo("vt", f"RULER variable tracking: every name of a {VT_HOPS}-hop chain in noise "
                 "(word recall)", 48, make_vt),
        TaskInfo("cwe", f"RULER common words: the {CWE_COMMON} most frequent of a numbered word "
                 "list (word recall)", 120, make_cwe),
        TaskInfo("fwe", f"RULER frequent words: the {FWE_ANSWERS} most frequent coded words, Zipf "
                 "counts (word recall)", 48, make_fwe),
    )
}
